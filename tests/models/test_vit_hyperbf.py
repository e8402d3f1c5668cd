"""The HyperBF ViT family: registration, configurations and timm's model API."""
import os
import subprocess
import sys

import pytest
import timm
import torch
from timm.optim import create_optimizer_v2

import timm_hbf  # noqa: F401  (registers the models)
from timm_hbf.models.vit_hyperbf import HyperBFBlock, VisionTransformerHyperBF

NAMES = [
    'vit_hyperbf_base', 'vit_hyperbf_base_patch16_224', 'vit_hyperbf_memo143_patch4_32', 'vit_hyperbf_small',
    'vit_hyperbf_small_patch16_224', 'vit_hyperbf_tiny', 'vit_hyperbf_tiny_patch16_224',
]


def small(**kwargs) -> VisionTransformerHyperBF:
    """A two-block vit_hyperbf_tiny (unless told otherwise), for speed."""
    torch.manual_seed(0)
    return timm.create_model('vit_hyperbf_tiny', **dict(dict(depth=2), **kwargs))


def images(batch: int = 2, size: int = 32, scale: float = 1.) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(0)) * scale


# --- registry -------------------------------------------------------------------------------------------------------

def test_registered_names():
    assert timm.list_models('vit_hyperbf*') == NAMES
    assert timm.list_models(module='vit_hyperbf') == NAMES


def test_names_are_new_to_timm():
    code = "import timm; print(timm.list_models('vit_hyperbf*') + timm.list_models(module='vit_hyperbf'))"
    env = dict(os.environ, TIMM_HBF_NO_AUTOLOAD='1')  # timm alone: without the import hook that registers ours
    out = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == '[]'


def test_no_tag_points_at_missing_weights():
    assert timm.list_pretrained('vit_hyperbf*') == []
    for name in NAMES:
        cfg = timm.models.get_pretrained_cfg(name)
        assert not (cfg.url or cfg.file or cfg.hf_hub_id or cfg.state_dict)


@pytest.mark.parametrize('name, size, patch, width, depth, heads, classes', [
    ('vit_hyperbf_tiny', 32, 4, 192, 12, 3, 10),
    ('vit_hyperbf_small', 32, 4, 384, 12, 6, 10),
    ('vit_hyperbf_base', 32, 4, 768, 12, 12, 10),
    ('vit_hyperbf_tiny_patch16_224', 224, 16, 192, 12, 3, 1000),
    ('vit_hyperbf_small_patch16_224', 224, 16, 384, 12, 6, 1000),
    ('vit_hyperbf_base_patch16_224', 224, 16, 768, 12, 12, 1000),
    ('vit_hyperbf_memo143_patch4_32', 32, 4, 768, 4, 4, 10),
])
def test_configurations(name, size, patch, width, depth, heads, classes):
    model = timm.create_model(name, device='meta')
    assert model.pretrained_cfg['input_size'] == (3, size, size)
    assert model.patch_embed.patch_size == (patch, patch)
    assert (model.embed_dim, len(model.blocks), model.blocks[0].attn.num_heads) == (width, depth, heads)
    assert model.num_classes == classes


def test_memo_configuration_follows_the_memo():
    model = timm.create_model('vit_hyperbf_memo143_patch4_32', device='meta')
    block = model.blocks[0]
    assert block.mlp.centers.shape == (3000, 768)
    assert block.attn.kernel.log_gamma.numel() == 1  # one attention width per layer
    assert block.attn.qkv.bias is None


def test_unknown_kwargs_raise_type_error():
    with pytest.raises(TypeError):
        timm.create_model('vit_hyperbf_tiny', not_a_model_arg=1)


@pytest.mark.parametrize('kwargs, message', [
    (dict(global_pool='max'), "Unknown global_pool 'max'"),
    (dict(class_token=False), "global_pool='token' needs class_token=True"),
    (dict(kernel='cauchy'), "Unknown HyperBF kernel 'cauchy'"),
    (dict(weight_init='jax'), "Unknown weight_init 'jax'"),
])
def test_bad_options_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        small(**kwargs)


# --- architecture ----------------------------------------------------------------------------------------------------

def test_block_is_pre_norm_with_both_residuals():
    torch.manual_seed(0)
    block = HyperBFBlock(48, 3)
    x = torch.randn(2, 5, 48)
    y = x + block.attn(block.norm1(x))
    torch.testing.assert_close(block(x), y + block.mlp(block.norm2(y)))


@pytest.mark.parametrize('kwargs', [
    dict(kernel='laplacian'), dict(mahalanobis=True), dict(mlp_normalized=True), dict(attn_gamma_per_head=False),
    dict(init_values=1e-5), dict(class_token=False, global_pool='avg'), dict(drop_path_rate=0.1, drop_rate=0.1),
])
def test_options_build_and_train_a_step(kwargs):
    model = small(**kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = torch.nn.functional.cross_entropy(model(images()), torch.tensor([1, 2]))
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    opt.step()
    assert torch.isfinite(model(images())).all()


def test_bf16_autocast_with_huge_inputs_has_no_nan_or_inf():
    model = small()
    x = images(scale=1e3)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out = model(x)
        out.float().sum().backward()
    assert torch.isfinite(out).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_widths_stay_positive_after_a_step_with_a_huge_learning_rate():
    model = small()
    opt = torch.optim.SGD(model.parameters(), lr=1e6)
    model(images()).square().sum().backward()
    opt.step()
    for name, module in model.named_modules():
        if hasattr(module, 'log_gamma'):
            gamma = module.gamma()
            assert (gamma > 0).all() and torch.isfinite(gamma).all(), name


# --- timm model API --------------------------------------------------------------------------------------------------

def test_forward_features_and_head():
    model = small().eval()
    feats = model.forward_features(images())
    assert feats.shape == (2, 1 + 64, 192)
    assert model.forward_head(feats, pre_logits=True).shape == (2, model.head_hidden_size)
    torch.testing.assert_close(model.forward_head(feats), model(images()))


def test_reset_classifier_and_get_classifier():
    model = small()
    model.reset_classifier(5)
    assert model.get_classifier().out_features == 5 and model(images()).shape == (2, 5)
    model.reset_classifier(0, 'avg')
    assert model(images()).shape == (2, 192) and model.global_pool == 'avg'
    model.reset_classifier(0, '')
    assert model(images()).shape == (2, 65, 192)


def test_device_dtype_and_meta_construction():
    model = timm.create_model('vit_hyperbf_tiny', depth=2, dtype=torch.float64)
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    assert model(images().double()).dtype == torch.float64
    meta = timm.create_model('vit_hyperbf_base_patch16_224', device='meta')
    assert {p.device.type for p in meta.parameters()} == {'meta'}


def test_grad_checkpointing_gives_identical_outputs_and_gradients():
    model = small(drop_path_rate=0.)
    x = images()
    out = model(x)
    out.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.set_grad_checkpointing(True)
    out_ckpt = model(x)
    out_ckpt.sum().backward()
    torch.testing.assert_close(out_ckpt, out)
    for a, b in zip((p.grad for p in model.parameters()), grads):
        torch.testing.assert_close(a, b)


def test_no_weight_decay_covers_widths_centres_metrics_and_embeddings():
    model = small(mahalanobis=True)
    nwd = model.no_weight_decay()
    names = dict(model.named_parameters())
    assert {'pos_embed', 'cls_token'} <= nwd
    expected = {n for n in names if n.endswith(('log_gamma', 'centers', 'metric'))}
    assert len(expected) == 2 * 2 + 2 * 1 + 2 * 2  # per block: 2 widths, 1 centre set, 2 metrics
    assert expected <= nwd and nwd <= set(names)
    opt = create_optimizer_v2(model, 'adamw', lr=1e-3, weight_decay=0.05, layer_decay=0.75)
    no_decay = {id(p) for g in opt.param_groups if g['weight_decay'] == 0. for p in g['params']}
    assert all(id(names[n]) in no_decay for n in expected)
    assert len({g['lr_scale'] for g in opt.param_groups}) > 2  # group_matcher gives per-block layer decay


def test_set_input_size_and_dynamic_img_size():
    model = small().eval()
    model.set_input_size(img_size=48)
    assert model.pos_embed.shape == (1, 1 + 144, 192)
    assert model(images(size=48)).shape == (2, 10)
    dynamic = small(dynamic_img_size=True).eval()
    for size in (32, 40, 64):
        assert dynamic(images(size=size)).shape == (2, 10)


def test_pretrained_loading_adapts_size_channels_and_classes(tmp_path):
    source = small()
    path = tmp_path / 'checkpoint.pth'
    torch.save({'state_dict': source.state_dict(), 'epoch': 3}, path)  # train.py's checkpoint format
    model = timm.create_model(
        'vit_hyperbf_tiny', depth=2, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)),
        img_size=64, in_chans=1, num_classes=5,
    )
    assert model.pos_embed.shape == (1, 1 + 256, 192)
    assert model.patch_embed.proj.weight.shape[1] == 1
    torch.testing.assert_close(model.blocks[1].mlp.centers, source.blocks[1].mlp.centers)
    assert model(torch.randn(2, 1, 64, 64)).shape == (2, 5)


def test_checkpoint_path_round_trip(tmp_path):
    source = small().eval()
    path = tmp_path / 'model.pth'
    torch.save(source.state_dict(), path)
    loaded = timm.create_model('vit_hyperbf_tiny', depth=2, checkpoint_path=str(path)).eval()
    torch.testing.assert_close(loaded(images()), source(images()))


# --- intermediates and features ---------------------------------------------------------------------------------------

def test_forward_intermediates():
    model = small(depth=4).eval()
    x = images()
    final, inter = model.forward_intermediates(x)
    torch.testing.assert_close(final, model.forward_features(x))
    assert len(inter) == 4 and inter[0].shape == (2, 192, 8, 8)
    tokens = model.forward_intermediates(x, indices=[0, -1], output_fmt='NLC', intermediates_only=True)
    assert [t.shape for t in tokens] == [(2, 64, 192)] * 2
    with_prefix = model.forward_intermediates(x, indices=1, return_prefix_tokens=True, intermediates_only=True)
    assert with_prefix[0][1].shape == (2, 1, 192)
    early = model.forward_intermediates(x, indices=[1], stop_early=True, intermediates_only=True)
    torch.testing.assert_close(early[0], inter[1])
    with pytest.raises(ValueError, match='out of range'):
        model.forward_intermediates(x, indices=[7])


def test_prune_and_features_only():
    model = small(depth=4).eval()
    x = images()
    full = model.forward_intermediates(x, indices=[1], intermediates_only=True)
    assert model.prune_intermediate_layers([1]) == [1]
    assert len(model.blocks) == 2 and isinstance(model.head, torch.nn.Identity)
    torch.testing.assert_close(model.forward_intermediates(x, indices=[1], intermediates_only=True), full)
    features = timm.create_model('vit_hyperbf_tiny', depth=4, features_only=True, out_indices=(1, 3)).eval()
    maps = features(x)
    assert [m.shape for m in maps] == [(2, 192, 8, 8)] * 2
    assert features.feature_info.channels() == [192, 192] and features.feature_info.reduction() == [4, 4]


@pytest.mark.parametrize('kwargs', [
    dict(), dict(kernel='laplacian'), dict(mahalanobis=True), dict(mlp_normalized=True),
    dict(class_token=False, global_pool='avg', init_values=1e-5),
])
def test_torchscript_matches_eager(kwargs):
    model = small(**kwargs).eval()
    scripted = torch.jit.script(model)
    with torch.no_grad():
        torch.testing.assert_close(scripted(images()), model(images()))
