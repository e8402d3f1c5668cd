"""The HyperBF ViT family: timm's VisionTransformer with HyperBF attention and MLPs, its registry entries, the
configurations of the memo, and every input and option timm's ViT takes."""
import math

import pytest
import timm
import torch
from timm.models import vision_transformer as vit
from timm.optim import create_optimizer_v2

import timm_hbf  # noqa: F401  (registers the models)
from tests.helpers import (
    assert_every_batch_gives_the_logits_of_its_images,
    assert_model_contract,
    compiled_matches_eager,
    images,
    legacy_checkpoint,
    run_as,
)
from timm_hbf.layers import HyperBFAttention, HyperBFMlp
from timm_hbf.models import VisionTransformerHyperBF

NAMES = [
    'vit_hyperbf_base', 'vit_hyperbf_base_patch16_224', 'vit_hyperbf_memo143_patch4_32', 'vit_hyperbf_nrbf_tiny',
    'vit_hyperbf_small', 'vit_hyperbf_small_patch16_224', 'vit_hyperbf_tiny', 'vit_hyperbf_tiny_patch16_224',
]
OPTIONS = {
    'default': {}, 'laplacian': dict(kernel='laplacian'), 'mahalanobis': dict(mahalanobis=True),
    'mlp_normalized': dict(mlp_normalized=True), 'one_attention_width': dict(attn_gamma_per_head=False),
}


def small(**kwargs) -> VisionTransformerHyperBF:
    """A two-block vit_hyperbf_tiny (unless told otherwise), for speed."""
    torch.manual_seed(0)
    return timm.create_model('vit_hyperbf_tiny', **dict(dict(depth=2), **kwargs))


def train_step(model, x=None):
    """One AdamW step on cross-entropy, in which every parameter gets a gradient."""
    x = images() if x is None else x
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.nn.functional.cross_entropy(model(x), torch.arange(x.shape[0]) % model.num_classes).backward()
    assert not [n for n, p in model.named_parameters() if p.grad is None]
    opt.step()
    opt.zero_grad()


# --- registry, configurations and timm's model contract --------------------------------------------------------------

def test_registered_names():
    assert timm.list_models('vit_hyperbf*') == timm.list_models(module='vit_hyperbf') == NAMES


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


def test_memo_configuration_follows_the_authors_code_and_nrbf_has_normalized_units():
    """The memo's model: 3000 centres, no qkv bias, one attention width per layer starting where the authors' learned
    scale starts (head_dim ** -0.5). vit_hyperbf_nrbf_tiny is vit_hyperbf_tiny with mlp_normalized=True."""
    block = timm.create_model('vit_hyperbf_memo143_patch4_32').blocks[0]
    assert block.attn.qkv.bias is None
    torch.testing.assert_close(block.attn.kernel.gamma(), torch.tensor([192 ** -0.5]))
    nrbf, plain = (timm.create_model(name, device='meta') for name in ('vit_hyperbf_nrbf_tiny', 'vit_hyperbf_tiny'))
    assert all(block.mlp.normalized for block in nrbf.blocks) and not any(b.mlp.normalized for b in plain.blocks)
    assert {k: v.shape for k, v in nrbf.state_dict().items()} == {k: v.shape for k, v in plain.state_dict().items()}


@pytest.mark.parametrize('name', [pytest.param(n, marks=pytest.mark.slow) if 'small' in n or 'base' in n else n
                                  for n in NAMES])  # the larger ones: the same code at other widths
def test_every_model_meets_timms_model_contract(name):
    assert_model_contract(name)


# --- architecture and options ----------------------------------------------------------------------------------------

@pytest.mark.parametrize('case', ['vit_hyperbf_default', 'vit_hyperbf_options', 'vit_hyperbf_avgpool'])
def test_checkpoints_of_version_0_1_load_and_give_their_logits(case):
    """Checkpoints that timm_hbf 0.1.0 wrote load strictly and reproduce its logits, on both attention paths. With
    average pooling 0.1.0 normed every token before pooling: ``fc_norm=False`` (timm's ViT option) builds that model."""
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


@pytest.mark.parametrize('kwargs, tokens', [
    *((options, 65) for options in OPTIONS.values()),
    (dict(init_values=1e-5), 65),
    (dict(drop_path_rate=0.1, drop_rate=0.1), 65),
    (dict(reg_tokens=4, class_token=False, global_pool='avg'), 64 + 4),
    (dict(no_embed_class=True), 65),
    (dict(qk_norm=True, scale_attn_norm=True, scale_mlp_norm=True), 65),
    (dict(global_pool='map'), 65),
    (dict(pos_embed='none', class_token=False, global_pool='avg'), 64),
    (dict(fix_init=True), 65),
    *((dict(block_fn=getattr(vit, block)), 65) for block in ('ResPostBlock', 'ParallelThingsBlock')),
], ids=[*OPTIONS, 'layer_scale', 'dropout', 'registers', 'no_embed_class', 'norms', 'attention_pool',
        'no_position_embedding', 'fix_init', 'post_norm_blocks', 'parallel_blocks'])
def test_every_option_is_timms_vit_with_hyperbf_layers_and_trains_a_step_with_a_gradient_for_every_parameter(
        kwargs, tokens):
    """timm's post-norm and parallel blocks too take the attention and MLP layers they are given."""
    model = small(**kwargs)
    assert isinstance(model, vit.VisionTransformer)
    assert {type(b) for b in model.blocks} == {kwargs.get('block_fn', vit.Block)}
    for kind in (HyperBFAttention, HyperBFMlp):
        assert all(any(isinstance(m, kind) for m in b.modules()) for b in model.blocks)
    assert model.forward_features(images()).shape == (2, tokens, 192)
    train_step(model)
    assert torch.isfinite(model(images())).all()


def test_dynamic_img_size_and_set_input_size():
    model = small(dynamic_img_size=True).eval()
    for size in (32, 40, 64):
        assert model(images(size=size)).shape == (2, 10)
    x = torch.randn(2, 3, 32, 48, generator=torch.Generator().manual_seed(0))  # a non-square grid
    static, dynamic = small(img_size=(32, 48)).eval(), small(img_size=(32, 48), dynamic_img_size=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(dynamic(x), static(x), rtol=0, atol=0)
    model = small().eval()
    model.set_input_size(img_size=48)
    assert model.pos_embed.shape == (1, 1 + 144, 192) and model(images(size=48)).shape == (2, 10)


def test_pretrained_loading_adapts_the_size(tmp_path):
    """The position embedding resampled as timm's ViT does (channels and classes: tests/models/test_builder.py)."""
    source = small()
    torch.save({'state_dict': source.state_dict(), 'epoch': 3}, tmp_path / 'checkpoint.pth')  # train.py's format
    model = timm.create_model('vit_hyperbf_tiny', depth=2, pretrained=True, img_size=64,
                              pretrained_cfg_overlay=dict(file=str(tmp_path / 'checkpoint.pth')))
    assert model.pos_embed.shape == (1, 1 + 256, 192) and model(torch.randn(2, 3, 64, 64)).shape == (2, 10)
    torch.testing.assert_close(model.blocks[1].mlp.centers, source.blocks[1].mlp.centers)


def test_weight_decay_spares_widths_centres_metrics_and_embeddings_and_layer_decay_goes_by_block():
    model = small(mahalanobis=True, reg_tokens=2)
    names = dict(model.named_parameters())
    spared = {n for n in names if n.endswith(('log_gamma', 'centers', 'metric'))} | {'pos_embed', 'cls_token',
                                                                                    'reg_token'}
    assert len(spared) == 2 * (2 + 1 + 2) + 3  # per block: 2 widths, 1 centre set, 2 metrics
    assert spared <= model.no_weight_decay()
    opt = create_optimizer_v2(model, 'adamw', lr=1e-3, weight_decay=0.05, layer_decay=0.75)
    no_decay = {id(p) for g in opt.param_groups if g['weight_decay'] == 0. for p in g['params']}
    assert all(id(names[n]) in no_decay for n in spared)
    assert len({g['lr_scale'] for g in opt.param_groups}) == 4  # stem, two blocks, head


@pytest.mark.parametrize('rate', ['attn_drop_rate', 'proj_drop_rate'])
def test_dropout_rates_reach_the_hyperbf_layers(rate):
    """timm's ViT hands ``attn_drop_rate`` to the attention's weights and ``proj_drop_rate`` to the attention's output
    and to the MLP's units and output (how they act: tests/layers)."""
    for b in small(**{rate: .5}).blocks:
        dropouts = [b.attn.attn_drop] if rate == 'attn_drop_rate' else [b.attn.proj_drop, b.mlp.drop1, b.mlp.drop2]
        assert [d.p for d in dropouts] == [.5] * len(dropouts)


def test_bf16_autocast_with_huge_inputs_has_no_nan_or_inf():
    model = small()
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out = model(images(scale=1e3))
        out.float().sum().backward()
    assert torch.isfinite(out).all() and all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_grad_checkpointing_gives_identical_outputs_and_gradients(checkpointing_reentrant):
    model = small()
    model(images()).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.set_grad_checkpointing(True)
    model(images()).sum().backward()
    for a, b in zip((p.grad for p in model.parameters()), grads):
        torch.testing.assert_close(a, b)


# --- arguments a user may get wrong ----------------------------------------------------------------------------------

def test_no_attention_width_means_the_default_and_a_given_one_is_kept():
    """-gamma ||q - k||^2 = 2 gamma q.k - gamma ||q||^2 - gamma ||k||^2: at the default width 1 / (2 sqrt(head_dim))
    the q.k term is q.k / sqrt(head_dim), the logits of scaled dot-product attention."""
    torch.testing.assert_close(small(attn_gamma_init=None).blocks[0].attn.kernel.gamma(),
                               torch.full((3,), 1 / (2 * math.sqrt(64))))
    torch.testing.assert_close(small(attn_gamma_init=0.3).blocks[1].attn.kernel.gamma(), torch.full((3,), 0.3))


@pytest.mark.parametrize('kwargs, error, named', [
    (dict(attn_gamma_init=0.), ValueError, 'attn_gamma_init .*got 0.0'),  # 0 is no "default": None is
    (dict(attn_gamma_init=float('nan')), ValueError, 'attn_gamma_init .*got nan'),
    (dict(attn_gamma_init='0.1'), TypeError, "attn_gamma_init .*got '0.1'"),
    (dict(kernel='Gaussian'), ValueError, "kernel .*got 'Gaussian'"),
    (dict(mlp_ratio=0.), ValueError, 'hidden_features .*mlp_ratio'),  # no centres, not embed_dim centres
    # ParallelScalingBlock fuses a linear attention and MLP of its own: it would be timm's ViT
    (dict(block_fn=timm.models.vision_transformer.ParallelScalingBlock), ValueError, 'block_fn .*ParallelScaling'),
])
def test_a_bad_argument_raises_naming_it_and_its_value(kwargs, error, named):
    with pytest.raises(error, match=named):
        small(**kwargs)


@pytest.mark.parametrize('kwargs, error, named', [
    (dict(depth=0), ValueError, 'depth .*got 0'),
    (dict(depth=1.5), TypeError, 'depth .*got 1.5'),
    (dict(num_classes=-1), ValueError, 'num_classes .*got -1'),
    (dict(in_chans=0), ValueError, 'in_chans .*got 0'),
    (dict(img_size='32'), ValueError, "img_size .*got '32'"),
    (dict(patch_size=0), ValueError, 'patch_size .*got 0'),
    (dict(reg_tokens=-1), ValueError, 'reg_tokens .*got -1'),
    (dict(drop_path_rate=1.), ValueError, 'drop_path_rate .*got 1.0'),
])
def test_timm_vit_arguments_are_checked_in_every_family(kwargs, error, named):
    """timm's ViT would build a model without blocks or head, or fail deep inside."""
    for family in ('vit_hyperbf_tiny', 'vit_qimia_tiny', 'vit_attnres_tiny'):
        with pytest.raises(error, match=named):
            timm.create_model(family, **dict(dict(depth=1), **kwargs))


# --- every batch timm's ViT takes, on either attention path ----------------------------------------------------------

@pytest.mark.parametrize('path', ['fused', 'reference'])
def test_every_batch_gives_the_logits_of_its_images(path):
    """The reference path serves timm's exportable models."""
    def build():
        model = small(exportable=path == 'reference')
        assert all(block.attn.fused_attn == (path == 'fused') for block in model.blocks)
        return model

    assert_every_batch_gives_the_logits_of_its_images(build)


# --- compilers -------------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize('option', OPTIONS)
def test_every_option_compiles_whole_scripts_and_exports(option):
    """torch.compile(fullgraph=True) (aot_eager), TorchScript and torch.export give the eager outputs."""
    model = small(depth=1, **OPTIONS[option])
    compiled_matches_eager(model, images(), 'aot_eager')
    with torch.no_grad():
        torch.testing.assert_close(torch.jit.script(model.eval())(images()), model(images()))
        torch.testing.assert_close(run_as('exported', model, images(3))(images(3)), model(images(3)))


@pytest.mark.slow
def test_whole_graph_compile_with_inductor():
    compiled_matches_eager(small(depth=1, embed_dim=48, num_heads=3), images(), 'inductor')
