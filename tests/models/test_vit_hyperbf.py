"""The HyperBF ViT family: timm's VisionTransformer with HyperBF attention and MLPs, its registry entries and the
configurations of the memo."""
import math
import os
import subprocess
import sys

import pytest
import timm
import torch
from timm.models import VisionTransformer
from timm.optim import create_optimizer_v2

import timm_hbf  # noqa: F401  (registers the models)
from timm_hbf.layers import HyperBFAttention, HyperBFMlp
from timm_hbf.models import VisionTransformerHyperBF

from ..helpers import compiled_matches_eager, legacy_checkpoint

NAMES = [
    'vit_hyperbf_base', 'vit_hyperbf_base_patch16_224', 'vit_hyperbf_memo143_patch4_32', 'vit_hyperbf_nrbf_tiny',
    'vit_hyperbf_small', 'vit_hyperbf_small_patch16_224', 'vit_hyperbf_tiny', 'vit_hyperbf_tiny_patch16_224',
]
OPTIONS = [
    dict(kernel='laplacian'), dict(mahalanobis=True), dict(mlp_normalized=True), dict(attn_gamma_per_head=False),
]
OPTION_IDS = ['laplacian', 'mahalanobis', 'mlp_normalized', 'one_attention_width']


def small(**kwargs) -> VisionTransformerHyperBF:
    """A two-block vit_hyperbf_tiny (unless told otherwise), for speed."""
    torch.manual_seed(0)
    return timm.create_model('vit_hyperbf_tiny', **dict(dict(depth=2), **kwargs))


def images(batch: int = 2, size: int = 32, scale: float = 1.) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(0)) * scale


def train_step(model, x=None):
    """One AdamW step on cross-entropy; returns the loss."""
    x = images() if x is None else x
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = torch.nn.functional.cross_entropy(model(x), torch.arange(x.shape[0]) % model.num_classes)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f'parameters without a gradient: {missing}'
    opt.step()
    opt.zero_grad()
    return loss


# --- registry -------------------------------------------------------------------------------------------------------

def test_registered_names():
    assert timm.list_models('vit_hyperbf*') == NAMES
    assert timm.list_models(module='vit_hyperbf') == NAMES


def test_names_are_new_to_timm():
    code = "import timm; print(timm.list_models('vit_hyperbf*') + timm.list_models(module='vit_hyperbf'))"
    env = dict(os.environ, TIMM_HBF_NO_AUTOLOAD='1')  # timm alone: without the import hook that registers ours
    out = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == '[]'


@pytest.mark.parametrize('name, size, patch, width, depth, heads, classes', [
    ('vit_hyperbf_tiny', 32, 4, 192, 12, 3, 10),
    ('vit_hyperbf_small', 32, 4, 384, 12, 6, 10),
    ('vit_hyperbf_base', 32, 4, 768, 12, 12, 10),
    ('vit_hyperbf_tiny_patch16_224', 224, 16, 192, 12, 3, 1000),
    ('vit_hyperbf_small_patch16_224', 224, 16, 384, 12, 6, 1000),
    ('vit_hyperbf_base_patch16_224', 224, 16, 768, 12, 12, 1000),
    ('vit_hyperbf_memo143_patch4_32', 32, 4, 768, 4, 4, 10),
    ('vit_hyperbf_nrbf_tiny', 32, 4, 192, 12, 3, 10),
])
def test_configurations(name, size, patch, width, depth, heads, classes):
    model = timm.create_model(name, device='meta')
    assert model.pretrained_cfg['input_size'] == (3, size, size)
    assert model.patch_embed.patch_size == (patch, patch)
    assert (model.embed_dim, len(model.blocks), model.blocks[0].attn.num_heads) == (width, depth, heads)
    assert model.blocks[0].mlp.centers.shape == (4 * width if 'memo' not in name else 3000, width)
    assert model.num_classes == classes


def test_memo_configuration_follows_the_authors_code():
    model = timm.create_model('vit_hyperbf_memo143_patch4_32')
    block = model.blocks[0]
    assert block.mlp.centers.shape == (3000, 768)
    assert block.attn.qkv.bias is None
    # one attention width per layer, starting where the authors' learned scale starts: head_dim ** -0.5
    torch.testing.assert_close(block.attn.kernel.gamma(), torch.tensor([192 ** -0.5]))


def test_nrbf_model_has_normalized_rbf_mlps():
    """vit_hyperbf_nrbf_tiny is vit_hyperbf_tiny with mlp_normalized=True: the same parameters, softmax units."""
    nrbf, plain = (timm.create_model(name, device='meta') for name in ('vit_hyperbf_nrbf_tiny', 'vit_hyperbf_tiny'))
    assert all(block.mlp.normalized for block in nrbf.blocks) and not any(b.mlp.normalized for b in plain.blocks)
    assert {k: v.shape for k, v in nrbf.state_dict().items()} == {k: v.shape for k, v in plain.state_dict().items()}


# --- architecture ----------------------------------------------------------------------------------------------------

def test_is_timms_vision_transformer_with_hyperbf_layers():
    model = small()
    assert isinstance(model, VisionTransformer)
    assert all(isinstance(b.attn, HyperBFAttention) and isinstance(b.mlp, HyperBFMlp) for b in model.blocks)
    assert all(type(b) is timm.models.vision_transformer.Block for b in model.blocks)


@pytest.mark.parametrize('block_fn', ['ResPostBlock', 'ParallelThingsBlock'])
def test_timms_other_blocks_are_built_with_hyperbf_layers(block_fn):
    """timm's post-norm and parallel blocks take the attention and MLP layers they are given, so ``block_fn`` makes
    a post-norm or parallel HyperBF ViT."""
    model = small(block_fn=getattr(timm.models.vision_transformer, block_fn))
    assert all(type(b).__name__ == block_fn for b in model.blocks)
    for kind in (HyperBFAttention, HyperBFMlp):
        assert all(any(isinstance(m, kind) for m in b.modules()) for b in model.blocks)
    train_step(model)


def test_a_block_that_builds_layers_of_its_own_is_rejected_and_not_built_into_a_plain_vit():
    """timm's ParallelScalingBlock takes attn_layer and mlp_layer but fuses a linear attention and MLP of its own:
    the model would be timm's ViT under a HyperBF name."""
    with pytest.raises(ValueError, match=r"block_fn must be a block that builds the attn_layer and mlp_layer it "
                                         r"is given, .* got <class '.*ParallelScalingBlock'>"):
        small(block_fn=timm.models.vision_transformer.ParallelScalingBlock)


@pytest.mark.parametrize('case', ['vit_hyperbf_default', 'vit_hyperbf_options', 'vit_hyperbf_avgpool'])
def test_checkpoints_of_version_0_1_load_and_give_their_logits(case):
    """Checkpoints that timm_hbf 0.1.0 wrote load strictly and reproduce its logits, on both attention paths. With
    average pooling 0.1.0 normed every token before pooling: ``fc_norm=False`` (timm's ViT option) builds that model;
    timm's default for 'avg' norms after pooling."""
    name, kwargs, state_dict, x, logits = legacy_checkpoint(case)
    if kwargs.get('global_pool') == 'avg':
        kwargs = dict(kwargs, fc_norm=False)
    model = timm.create_model(name, **kwargs).eval()
    model.load_state_dict(state_dict)
    with torch.no_grad():
        torch.testing.assert_close(model(x), logits, atol=1e-5, rtol=1e-5)
        for block in model.blocks:
            block.attn.fused_attn = False
        torch.testing.assert_close(model(x), logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('kwargs', OPTIONS + [dict(init_values=1e-5), dict(drop_path_rate=0.1, drop_rate=0.1)],
                         ids=OPTION_IDS + ['layer_scale', 'dropout'])
def test_options_train_a_step_with_a_gradient_for_every_parameter(kwargs):
    model = small(**kwargs)
    train_step(model)
    assert torch.isfinite(model(images())).all()


@pytest.mark.parametrize('kwargs, tokens', [
    (dict(reg_tokens=4, class_token=False, global_pool='avg'), 64 + 4),
    (dict(no_embed_class=True), 64 + 1),
    (dict(qk_norm=True, scale_attn_norm=True, scale_mlp_norm=True), 64 + 1),
    (dict(global_pool='map'), 64 + 1),
    (dict(pos_embed='none', class_token=False, global_pool='avg'), 64),
    (dict(fix_init=True), 64 + 1),
], ids=['registers', 'no_embed_class', 'norms', 'attention_pool', 'no_position_embedding', 'fix_init'])
def test_vit_options_work(kwargs, tokens):
    model = small(**kwargs)
    assert model.forward_features(images()).shape == (2, tokens, 192)
    train_step(model)


def test_dynamic_img_size_and_set_input_size():
    model = small(dynamic_img_size=True).eval()
    for size in (32, 40, 64):
        assert model(images(size=size)).shape == (2, 10)
    x = torch.randn(2, 3, 32, 48, generator=torch.Generator().manual_seed(0))  # a non-square grid
    static, dynamic = small(img_size=(32, 48)).eval(), small(img_size=(32, 48), dynamic_img_size=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(dynamic(x), static(x), rtol=0, atol=0)
        assert dynamic(torch.randn(2, 3, 48, 32)).shape == (2, 10)
    model = small().eval()
    model.set_input_size(img_size=48)
    assert model.pos_embed.shape == (1, 1 + 144, 192)
    assert model(images(size=48)).shape == (2, 10)


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


def test_no_weight_decay_covers_widths_centres_metrics_and_embeddings():
    model = small(mahalanobis=True, reg_tokens=2)
    nwd = model.no_weight_decay()
    names = dict(model.named_parameters())
    embeddings = {'pos_embed', 'cls_token', 'reg_token'}
    assert embeddings <= nwd
    kernel = {n for n in names if n.endswith(('log_gamma', 'centers', 'metric'))}
    assert len(kernel) == 2 * (2 + 1 + 2)  # per block: 2 widths, 1 centre set, 2 metrics
    assert kernel <= nwd
    expected = kernel | embeddings
    opt = create_optimizer_v2(model, 'adamw', lr=1e-3, weight_decay=0.05, layer_decay=0.75)
    no_decay = {id(p) for g in opt.param_groups if g['weight_decay'] == 0. for p in g['params']}
    assert all(id(names[n]) in no_decay for n in expected)
    assert len({g['lr_scale'] for g in opt.param_groups}) > 2  # group_matcher gives per-block layer decay


@pytest.mark.parametrize('rate', ['attn_drop_rate', 'proj_drop_rate'])
def test_dropout_rates_reach_the_hyperbf_layers_and_act_in_training_only(rate):
    """timm's ViT hands ``attn_drop_rate`` to the attention's weights and ``proj_drop_rate`` to the attention's output
    and to the MLP's units and output: each draw in training another, in evaluation the model without dropout."""
    model, plain = small(**{rate: .5}), small().eval()
    for b in model.blocks:
        dropouts = [b.attn.attn_drop] if rate == 'attn_drop_rate' else [b.attn.proj_drop, b.mlp.drop1, b.mlp.drop2]
        assert [d.p for d in dropouts] == [.5] * len(dropouts)
    x = images()
    torch.manual_seed(0)
    with torch.no_grad():
        assert not torch.allclose(model(x), model(x))
        torch.testing.assert_close(model.eval()(x), plain(x))


# --- numerics --------------------------------------------------------------------------------------------------------

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


@pytest.mark.parametrize('grad', [True, False], ids=['training', 'inference'])
def test_forward_hooks_see_what_each_layer_returned(grad):
    model = small()
    kept = []
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(lambda m, args, out: kept.append((out, out.detach().clone())))
    with torch.set_grad_enabled(grad):
        model(images())
    assert len(kept) == 2 * 3 + 1
    assert all(torch.equal(out, copy) for out, copy in kept)


def test_grad_checkpointing_gives_identical_outputs_and_gradients(checkpointing_reentrant):
    model = small()
    x = images()
    model(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.set_grad_checkpointing(True)
    model(x).sum().backward()
    for a, b in zip((p.grad for p in model.parameters()), grads):
        torch.testing.assert_close(a, b)


# --- compilers -------------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize('kwargs', [dict()] + OPTIONS, ids=['default'] + OPTION_IDS)
def test_whole_graph_compile_captures_eval_and_a_training_step(kwargs):
    """fullgraph=True raises on any graph break; aot_eager runs the captured forward and backward graphs as they are."""
    compiled_matches_eager(small(depth=1, **kwargs), images(), 'aot_eager')


@pytest.mark.slow
def test_whole_graph_compile_with_inductor():
    compiled_matches_eager(small(depth=1, embed_dim=48, num_heads=3), images(), 'inductor')


@pytest.mark.parametrize('kwargs', [dict()] + OPTIONS, ids=['default'] + OPTION_IDS)
def test_torchscript_matches_eager(kwargs):
    model = small(**kwargs).eval()
    scripted = torch.jit.script(model)
    with torch.no_grad():
        torch.testing.assert_close(scripted(images()), model(images()))


def test_exportable_builds_take_the_reference_path():
    model = timm.create_model('vit_hyperbf_tiny', depth=1, exportable=True)
    assert not any(b.attn.fused_attn for b in model.blocks)
    assert all(b.attn.fused_attn for b in small().blocks)


def test_attention_widths_start_at_half_the_inverse_root_head_width_by_default():
    model = small()
    torch.testing.assert_close(model.blocks[0].attn.kernel.gamma(), torch.full((3,), 1 / (2 * math.sqrt(64))))


# --- arguments a user may get wrong ----------------------------------------------------------------------------------

@pytest.mark.parametrize('width', [0., -1., float('inf'), float('nan')])
def test_a_zero_or_non_finite_attention_width_is_rejected_with_the_argument_named(width):
    """0 is not taken as "the default" (None is): a width is > 0 and finite."""
    with pytest.raises(ValueError, match=rf'attn_gamma_init \(the initial attention width; None for the default\) '
                                         rf'must be a finite number > 0, got {width}'):
        small(attn_gamma_init=width)


def test_an_attention_width_that_is_not_a_number_is_rejected_with_the_argument_named():
    with pytest.raises(TypeError, match=r"attn_gamma_init .* must be a finite number > 0, got '0.1' \(str\)"):
        small(attn_gamma_init='0.1')


def test_no_attention_width_means_the_default_and_a_given_one_is_kept():
    torch.testing.assert_close(small(attn_gamma_init=None).blocks[0].attn.kernel.gamma(),
                               torch.full((3,), 1 / (2 * math.sqrt(64))))
    torch.testing.assert_close(small(attn_gamma_init=0.3).blocks[1].attn.kernel.gamma(), torch.full((3,), 0.3))


def test_an_unknown_kernel_is_rejected_with_the_choices_named():
    with pytest.raises(ValueError, match=r"kernel must be one of \('gaussian', 'laplacian'\), got 'Gaussian'"):
        small(kernel='Gaussian')


@pytest.mark.parametrize('kwargs, error, message', [
    (dict(depth=0), ValueError, r'depth must be an integer >= 1, got 0'),
    (dict(depth=1.5), TypeError, r'depth must be an integer >= 1, got 1.5 \(float\)'),
    (dict(num_classes=-1), ValueError, r'num_classes must be an integer >= 0, got -1'),
    (dict(in_chans=0), ValueError, r'in_chans must be an integer >= 1, got 0'),
    (dict(img_size='32'), ValueError, r"img_size must be an integer >= 1 or a pair of them .*, got '32'"),
    (dict(patch_size=0), ValueError, r'patch_size must be an integer >= 1 or a pair of them .*, got 0'),
    (dict(reg_tokens=-1), ValueError, r'reg_tokens must be an integer >= 0, got -1'),
    (dict(drop_path_rate=1.), ValueError, r'drop_path_rate must be a rate in \[0, 1\), got 1.0'),
], ids=['no_blocks', 'fractional_depth', 'negative_classes', 'no_channels', 'size_as_text', 'zero_patch',
        'negative_registers', 'drop_every_path'])
def test_timm_vit_arguments_are_checked_as_the_qimia_family_checks_them(kwargs, error, message):
    """timm's ViT would build a model without blocks at depth 0 or without a head at num_classes -1, and fail deep
    inside on the rest."""
    with pytest.raises(error, match=message):
        small(**kwargs)
    for family in ('vit_qimia_tiny', 'vit_attnres_tiny'):
        with pytest.raises(error, match=message):
            timm.create_model(family, **dict(dict(depth=1), **kwargs))


def test_an_mlp_with_no_centres_is_rejected_with_the_argument_named():
    """mlp_ratio=0 gives no centres; it is not silently replaced by embed_dim centres."""
    with pytest.raises(ValueError, match=r'hidden_features \(the number of centres; mlp_ratio \* embed_dim in a ViT\) '
                                         r'must be an integer >= 1, got 0'):
        small(mlp_ratio=0.)


# --- every batch timm's ViT takes ------------------------------------------------------------------------------------

def vit_and_hyperbf(path: str):
    """timm's ViT-Ti at the CIFAR setting and a vit_hyperbf_tiny of the same size, two blocks each, the latter on the
    attention ``path`` ('fused' or 'reference')."""
    torch.manual_seed(0)
    vit = timm.create_model('vit_tiny_patch16_224', img_size=32, patch_size=4, num_classes=10, depth=2)
    hyperbf = small()
    for block in hyperbf.blocks:
        block.attn.fused_attn = path == 'fused'
    return vit, hyperbf


def logits_and_step(model, x):
    """Eval logits of ``x``, after a training step's forward and backward pass on it in which every parameter gets a
    finite gradient."""
    model.train()
    model.zero_grad(set_to_none=True)
    logits = model(x)
    logits.float().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert logits.shape == (x.shape[0], model.num_classes) and logits.dtype == x.dtype
    model.eval()
    with torch.no_grad():
        return model(x)


PATHS = pytest.mark.parametrize('path', ['fused', 'reference'])


@PATHS
def test_an_empty_batch_gives_empty_logits_as_for_timms_vit(path):
    vit, hyperbf = vit_and_hyperbf(path)
    x = images(batch=0)
    assert logits_and_step(vit, x).shape == (0, 10)
    assert logits_and_step(hyperbf, x).shape == (0, 10)


@PATHS
def test_one_image_gives_the_logits_it_gets_in_a_batch(path):
    vit, hyperbf = vit_and_hyperbf(path)
    x = images(batch=3)
    logits_and_step(vit, x[:1])
    torch.testing.assert_close(logits_and_step(hyperbf, x[:1]), logits_and_step(hyperbf, x)[:1], atol=1e-5, rtol=1e-5)


@PATHS
@pytest.mark.parametrize('layout', ['channels_last', 'non_contiguous'])
def test_a_channels_last_or_strided_input_gives_the_logits_of_its_contiguous_copy(path, layout):
    vit, hyperbf = vit_and_hyperbf(path)
    x = images(batch=3, size=64)[:, :, ::2, ::2] if layout == 'non_contiguous' else \
        images(batch=3).contiguous(memory_format=torch.channels_last)
    assert not x.is_contiguous()
    logits_and_step(vit, x)
    torch.testing.assert_close(logits_and_step(hyperbf, x), logits_and_step(hyperbf, x.contiguous()))


@PATHS
@pytest.mark.parametrize('dtype, tolerance', [(torch.bfloat16, 2e-2), (torch.float16, 5e-3)], ids=['bf16', 'fp16'])
def test_a_half_precision_model_runs_on_the_cpu_close_to_float32(path, dtype, tolerance):
    """Model and input in bf16 or fp16 (no autocast), as timm's ViT takes them: a training step, and logits in that
    dtype within a relative error (norm-wise; about 3 to 6 times what it was when written) of the float32 model's."""
    vit, hyperbf = vit_and_hyperbf(path)
    x = images(batch=4)
    expected = logits_and_step(hyperbf, x).double()
    logits_and_step(vit.to(dtype), x.to(dtype))
    logits = logits_and_step(hyperbf.to(dtype), x.to(dtype)).double()
    assert (logits - expected).norm() < tolerance * expected.norm()
