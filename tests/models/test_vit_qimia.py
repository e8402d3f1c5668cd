"""The QIMIA ViT family and Attention Residuals: depth attention in place of residuals (Eq. 1 over the entries each read
sees), the report's and AttnRes's options, every input a user may give, timm's API, and every execution mode."""
import json
from typing import List, NamedTuple, Optional

import pytest
import timm
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from timm.data import ImageDataset, create_transform
from timm.layers import Attention, AttentionPoolLatent, AttentionPoolPrr, resample_abs_pos_embed, resample_patch_embed
from timm.models import save_for_hf
from timm.optim import create_optimizer_v2

import timm_hbf  # noqa: F401  (registers the models)
from tests.helpers import (
    EXECUTION_MODES,
    assert_every_batch_gives_the_logits_of_its_images,
    assert_model_contract,
    compiled_matches_eager,
    images,
    legacy_checkpoint,
    run_as,
    saved_activation_bytes,
)
from timm_hbf.layers import AttnResBlock, DepthAttention, depth_weights
from timm_hbf.models._builder import CIFAR10_MEAN, CIFAR10_STD
from timm_hbf.models.vit_qimia import VisionTransformerQimia, checkpoint_filter_fn

NAMES = timm.list_models(module=['vit_qimia', 'vit_attnres'])
ATTNRES = dict(keys_from_values=True, sublayer_values=True, depth_num_heads=1)
OPTIONS = {
    'default': {}, 'key_dim': dict(key_dim=32), 'depth_heads': dict(depth_num_heads=2), 'key_norm': dict(key_norm=True),
    'batchnorm_values': dict(value_norm='batchnorm'), 'gaussian_depth_attention': dict(depth_kernel='gaussian'),
    'path_dropout': dict(drop_path_rate=.2), 'null_entry': dict(null_entry=True),
    'block_memory': dict(memory_block_size=3), 'avg_pool': dict(global_pool='avg', class_token=False),
    'map_pool': dict(global_pool='map'), 'prr_pool': dict(global_pool='prr'), 'register_tokens': dict(reg_tokens=4),
    'qk_norm': dict(qk_norm=True), 'keys_from_values': dict(keys_from_values=True),
    'sublayer_values': dict(sublayer_values=True), 'one_depth_head': dict(depth_num_heads=1),
    'attnres': ATTNRES, 'block_attnres': dict(ATTNRES, memory_block_size=4),
}
# every option away from its default, in one model (and AttnRes's with the report's)
ALL_OPTIONS = dict(
    key_dim=32, key_norm=True, value_norm='batchnorm', depth_kernel='gaussian', drop_path_rate=.2, null_entry=True,
    memory_block_size=2, global_pool='avg', class_token=False, reg_tokens=2, qk_norm=True,
)
ALL_ATTNRES_OPTIONS = dict(ATTNRES, value_norm='batchnorm', depth_kernel='gaussian', drop_path_rate=.2,
                           null_entry=True, memory_block_size=2, global_pool='map')
FAMILIES = {'qimia': {}, 'attnres': ATTNRES}


def small(queries: float = 0., **kwargs) -> VisionTransformerQimia:
    """A two-layer vit_qimia_tiny (unless told otherwise), with queries of standard deviation ``queries``."""
    torch.manual_seed(0)
    model = timm.create_model('vit_qimia_tiny', **dict(dict(depth=2), **kwargs))
    if queries:
        randomize_queries(model, queries)
    return model


def randomize_queries(model: torch.nn.Module, std: float = .5, per_width: bool = False) -> None:
    """Queries start at zero, where keys get no gradient. ``per_width``: ``std / sqrt(width)`` of a depth head, the
    scale of trained queries (the shipped weights': about 0.4 / sqrt(width))."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith('query'):
                p.copy_(torch.randn(p.shape, generator=g) * std / (p.shape[-1] ** .5 if per_width else 1.))


class Sublayer(NamedTuple):
    """A sublayer of either kind of block: its read, norm, body, layer scale, and key and value paths."""
    read: DepthAttention
    norm: torch.nn.Module
    body: torch.nn.Module
    scale: torch.nn.Module
    key: Optional[torch.nn.Module]
    value: torch.nn.Module


def sublayers(model: VisionTransformerQimia) -> List[Sublayer]:
    out = []
    for layer in model.blocks:
        if isinstance(layer, AttnResBlock):
            out += [Sublayer(layer.read1, layer.norm1, layer.attn, layer.ls1, layer.key1, layer.value_norm1),
                    Sublayer(layer.read2, layer.norm2, layer.mlp, layer.ls2, layer.key2, layer.value_norm2)]
        else:
            out += [Sublayer(b.read, b.norm, b.body, torch.nn.Identity(), b.key, b.value)
                    for b in (layer.attn, layer.mlp)]
    return out


def eq1(read: DepthAttention, entries: list) -> torch.Tensor:
    """Eq. 1 over explicit (stored key, value) entries: one softmax over all their logits, the sum of their values."""
    weights = depth_weights(read.memory_query(), [k for k, _ in entries], read.rms_logits)[..., 0, :]  # (.., H, L)
    values = torch.stack(torch.broadcast_tensors(*[v.float() for _, v in entries]), -2)  # (..., L, D)
    values = values.unflatten(-1, (read.num_heads, -1)).transpose(-3, -2)  # (..., H, L, Dv)
    return (weights.unsqueeze(-2) @ values).squeeze(-2).flatten(-2)


def reference_features(model: VisionTransformerQimia, x: torch.Tensor) -> tuple:
    """``forward_features`` computed directly, every read :func:`eq1` over the entries it sees (the stem's, the
    finished block summaries and the current one; without a read, the one entry there is); and those entries."""
    read_out = model.read_out
    entries = [(read_out.key(v if k is None else k), v) for k, v in model.embed(x)]
    seen, current = [], None
    for block in sublayers(model):
        read = block.read
        visible = entries + ([current] if read.position > 0 else [])
        seen.append(visible)
        h = block.norm(eq1(read, visible) if read.query is not None else visible[-1][1])
        h = block.scale(block.body(h))
        key, value = None if block.key is None else read.key(block.key(h)), block.value(h)
        if read.position > 0:
            value = current[1] + value
            key = None if key is None else (current[0] * read.position + key) / (read.position + 1)
        current = (read.key(value) if key is None else key, value)
        if read.commit:
            entries = entries + [current]
    visible = entries + ([current] if read_out.position > 0 else [])
    seen.append(visible)
    return model.norm(eq1(read_out, visible)), seen


# --- registry, configurations and timm's model contract --------------------------------------------------------------

def test_registered_names():
    assert timm.list_models(module='vit_qimia') == [
        'vit_qimia_base', 'vit_qimia_base_patch16_224', 'vit_qimia_small', 'vit_qimia_small_patch16_224',
        'vit_qimia_surf23_patch8_32', 'vit_qimia_tiny', 'vit_qimia_tiny_patch16_224']
    assert set(timm.list_models(module='vit_attnres')) == set(timm.list_models('vit_attnres*'))


@pytest.mark.parametrize('name, size, patch, width, heads, key_dim, depth_heads', [
    ('vit_qimia_tiny', 32, 4, 192, 3, 64, 8),
    ('vit_qimia_small', 32, 4, 384, 6, 128, 16),
    ('vit_qimia_base', 32, 4, 768, 12, 256, 32),
    ('vit_qimia_tiny_patch16_224', 224, 16, 192, 3, 64, 8),
    ('vit_qimia_small_patch16_224', 224, 16, 384, 6, 128, 16),
    ('vit_qimia_base_patch16_224', 224, 16, 768, 12, 256, 32),
    ('vit_attnres_tiny', 32, 4, 192, 3, 192, 1),
    ('vit_attnres_block_tiny', 32, 4, 192, 3, 192, 1),
    ('vit_attnres_tiny_patch16_224', 224, 16, 192, 3, 192, 1),
    ('vit_attnres_block_tiny_patch16_224', 224, 16, 192, 3, 192, 1),
])
def test_configurations(name, size, patch, width, heads, key_dim, depth_heads):
    model = timm.create_model(name, device='meta')
    assert model.pretrained_cfg['input_size'] == (3, size, size)
    assert model.patch_embed.patch_size == (patch, patch)
    attn, mlp = sublayers(model)[:2]
    assert (model.embed_dim, len(model.blocks), attn.body.num_heads) == (width, 12, heads)
    assert mlp.read.query.shape == (depth_heads, key_dim // depth_heads)


@pytest.mark.parametrize('name, positions', [('vit_attnres_tiny', [0]), ('vit_attnres_block_tiny', [0, 1, 2, 3])])
def test_attnres_models_set_every_attnres_difference_and_block_attnres_blocks_of_two_layers(name, positions):
    """Keys from values, sublayer values; the first sublayer takes the token embedding as it is (no read)."""
    model = timm.create_model(name, device='meta')
    assert model.patch_key is None and all(b.key is None for b in sublayers(model)) and model.sublayer_values
    assert [b.read.query is not None for b in sublayers(model)] == [False] + [True] * 23
    assert [b.read.position for b in sublayers(model)] == positions * (24 // len(positions))


def test_report_configuration():
    """SURF report appendix: embed 256, depth 10, patch 8, FF hidden 1024, key dim 256 (32 heads of 8); the report's
    blocks: PReLU key and value paths, separate after the shared hidden layer, no affine LayerNorm."""
    model = timm.create_model('vit_qimia_surf23_patch8_32')
    layer = model.blocks[0]
    assert (model.embed_dim, len(model.blocks), model.patch_embed.patch_size) == (256, 10, (8, 8))
    assert (layer.mlp.body[0].out_features, layer.attn.read.query.shape, model.num_classes) == (1024, (32, 8), 10)
    assert len(reference_features(model, images(1))[1][-1]) == 22  # patch, position, two per layer
    assert [type(m).__name__ for b in (layer.attn, layer.mlp) for m in (b.key, b.value)] == ['PReLULinear'] * 4
    assert layer.mlp.key.slope is not layer.mlp.value.slope
    assert layer.mlp.key.fc.in_features == layer.mlp.value.fc.in_features == layer.mlp.body[0].out_features
    assert not any(isinstance(m, torch.nn.LayerNorm) and m.elementwise_affine for m in layer.modules())


@pytest.mark.parametrize('name', [pytest.param(n, marks=pytest.mark.slow) if 'small' in n or 'base' in n else n
                                  for n in NAMES])  # the larger ones: the same code at other widths
def test_every_model_meets_timms_model_contract(name):
    assert_model_contract(name)


# --- depth attention ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('option', [o for o in OPTIONS if o != 'path_dropout'])
def test_every_read_is_eq_1_over_the_entries_it_sees(option):
    """The memory's online sums give, for every option, what Eq. 1 computed over explicit entries gives."""
    model = small(.5, depth=3, **OPTIONS[option]).eval()
    with torch.no_grad():
        expected, _ = reference_features(model, images())
        torch.testing.assert_close(model.forward_features(images()), expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize('family', FAMILIES)
def test_block_memory_reads_the_stem_the_finished_summaries_and_the_current_one(family):
    """memory_block_size 3: sublayers 0-2 and 3-5 form two summaries (values summed); every read sees the stem's
    entries, the finished summaries and the current one (Block AttnRes)."""
    model = small(.5, depth=3, memory_block_size=3, **FAMILIES[family]).eval()
    values = []
    for block in sublayers(model):
        block.value.register_forward_hook(lambda m, i, o: values.append(o))
    with torch.no_grad():
        _, seen = reference_features(model, images())
    assert [len(visible) - len(seen[0]) for visible in seen] == [0, 1, 1, 1, 2, 2, 2]
    torch.testing.assert_close(seen[-1][-1][1], sum(values[3:]))  # the output read sees the second summary
    torch.testing.assert_close(seen[4][-1][1], values[3])  # the second block's second read, its first entry
    torch.testing.assert_close(seen[4][-2][1], sum(values[:3]))  # and the first block's summary


def test_null_entry_is_read_first_with_a_learned_key_also_under_keys_from_values():
    """A normalised zero vector has no useful gradient (rms_norm's Jacobian at 0 is 1 / sqrt(eps)): the null entry
    keeps a learned key of its own."""
    model = small(null_entry=True, **ATTNRES)
    (key, value), *rest = model.embed(images())
    assert key is model.null_key and value is model.null_value and model.null_key.norm() > 1
    assert [value.shape for _, value in small(null_entry=True).embed(images())] == [(192,), (2, 65, 192), (1, 65, 192)]


def test_attnres_is_eq_1_2_over_the_embedding_and_the_sublayer_outputs():
    """Full AttnRes: h_l = sum_i softmax_i(w_l . RMSNorm(v_i)) v_i over the embedding v_0 and every earlier sublayer's
    output, each sublayer timm's pre-norm Attention or Mlp of its h_l; the first takes v_0 itself."""
    model = timm.create_model('vit_attnres_tiny', depth=2).eval()
    randomize_queries(model)
    assert [type(b.body).__name__ for b in sublayers(model)[:2]] == ['Attention', 'Mlp']
    inputs, outputs = [], []
    for block in sublayers(model):
        block.norm.register_forward_pre_hook(lambda m, i: inputs.append(i[0]))
        block.body.register_forward_hook(lambda m, i, o: outputs.append(o))
    x = images()
    with torch.no_grad():
        model(x)
        (_, v0), = model.embed(x)
    torch.testing.assert_close(inputs[0], v0)
    for index, block in enumerate(sublayers(model)[1:], 1):
        v = torch.stack([v0] + outputs[:index])
        w = (F.rms_norm(v, [v.shape[-1]], eps=1e-6) @ block.read.query[0]).softmax(0)
        torch.testing.assert_close(inputs[index], (w.unsqueeze(-1) * v).sum(0), rtol=0, atol=1e-5)


# --- memory and precision -------------------------------------------------------------------------------------------

@pytest.mark.parametrize('family', FAMILIES)
def test_training_keeps_memory_linear_in_depth(family):
    """What a training step keeps for backward grows by the same amount a layer: no read keeps a copy of the memory."""
    saved = [saved_activation_bytes(small(depth=depth, **FAMILIES[family]), images()) for depth in (2, 4, 8)]
    assert saved[2] - saved[1] == pytest.approx(2 * (saved[1] - saved[0]), rel=.1)


def test_block_memory_frees_merged_entries_in_inference():
    """memory_block_size 2: every value a sublayer writes is freed once merged into its summary or stored."""
    import gc
    import weakref

    model = small(depth=3, memory_block_size=2).eval()
    written, alive = [], []
    for block in sublayers(model):
        block.value.register_forward_hook(lambda m, i, o: written.append(weakref.ref(o)))

    def at_output_read(module, args):
        gc.collect()
        alive.extend(ref() is not None for ref in written)

    model.read_out.register_forward_pre_hook(at_output_read)
    with torch.no_grad():
        model(images())
    assert alive == [False] * 6


@pytest.mark.parametrize('option', ['path_dropout', 'block_attnres'])
def test_grad_checkpointing_gives_identical_outputs_and_gradients(option, checkpointing_reentrant):
    """With an attention mask too. Reentrant checkpointing sees only the tensors passed to it: the memory goes to each
    layer as tensors (the gradients then equal up to float32 rounding: a stack's gradients add up in another order)."""
    model = small(.5, **dict(OPTIONS[option], depth=3))
    mask = torch.ones(65, 65).tril().bool()
    results = []
    for checkpointing in (False, True):
        model.set_grad_checkpointing(checkpointing)
        torch.manual_seed(2)  # the same dropout masks in both runs
        out = model(images(), attn_mask=mask)
        out.sum().backward()
        results.append((out, {n: p.grad for n, p in model.named_parameters()}))
        model.zero_grad(set_to_none=True)
    (out, grads), (out_ckpt, grads_ckpt) = results
    torch.testing.assert_close(out_ckpt, out, rtol=0, atol=0)
    for name, grad in grads.items():
        atol = 1e-6 * grad.abs().max().item() if checkpointing_reentrant else 0
        torch.testing.assert_close(grads_ckpt[name], grad, rtol=0, atol=atol, msg=name)


# --- options --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('family', FAMILIES)
def test_dropout_rates_act_in_training_only(family):
    """Each of timm's ViT dropout rates: each draw in training another, in evaluation the model without dropout."""
    plain = small(.5, **FAMILIES[family]).eval()
    for rate in ('drop_rate', 'pos_drop_rate', 'proj_drop_rate', 'attn_drop_rate'):
        model = small(.5, **FAMILIES[family], **{rate: .5})
        with torch.no_grad():
            assert not torch.allclose(model(images()), model(images())), rate
            torch.testing.assert_close(model.eval()(images()), plain(images()), msg=rate)


def real_batch(root, count: int = 8):
    """``count`` CIFAR-10 test images of the committed sample, one class after another, normalised as the models'."""
    data = ImageDataset(str(root / 'test'), transform=create_transform(32, mean=CIFAR10_MEAN, std=CIFAR10_STD))
    picks = [data[i * 20] for i in range(count)]
    return torch.stack([image for image, _ in picks]), torch.tensor([label for _, label in picks])


def gradients(model: torch.nn.Module, batch, step: bool = False) -> dict:
    """The gradients of a training loss on ``batch`` (then an AdamW step, with ``step``)."""
    model.zero_grad()
    F.cross_entropy(model.train()(batch[0]), batch[1]).backward()
    grads = {n: p.grad.detach().clone() if p.grad is not None else None for n, p in model.named_parameters()}
    if step:
        create_optimizer_v2(model, 'adamw', lr=1e-3).step()
    return grads


@pytest.mark.parametrize('options', [
    pytest.param(ALL_OPTIONS, id='every_option'), pytest.param(ALL_ATTNRES_OPTIONS, id='every_attnres_option'),
    *(pytest.param(options, id=option, marks=pytest.mark.slow) for option, options in OPTIONS.items()),
])
def test_every_parameter_gets_a_gradient_none_out_of_scale(options, cifar10_sample):
    """After one optimizer step from init (zero queries give keys none), every parameter gets a non-zero, finite
    gradient on real images; with queries at a trained scale, no gradient norm but the head's is 100 x the median."""
    model, batch = small(**options, num_classes=10), real_batch(cifar10_sample)
    gradients(model, batch, step=True)
    grads = gradients(model, batch)
    assert not [n for n, g in grads.items() if g is None or not torch.isfinite(g).all() or not g.abs().sum() > 0]
    randomize_queries(model, per_width=True)
    norms = {n: g.norm() for n, g in gradients(model, batch).items() if not n.startswith('head.')}
    median = torch.stack(list(norms.values())).median()
    assert not {n: round(float(v / median)) for n, v in norms.items() if v > 100 * median}


@pytest.mark.parametrize('block_size, kept', [(3, 1), (4, 2)], ids=['block-left-unfinished', 'blocks-finished'])
@pytest.mark.parametrize('family', FAMILIES)
def test_a_pruned_model_and_one_stopped_early_are_the_model_of_their_depth(family, block_size, kept):
    """``prune_intermediate_layers`` leaves the model that its layers make, and ``forward_intermediates`` stopped
    early returns its features, also where the model's last memory block is another than theirs."""
    model = small(.5, depth=3, memory_block_size=block_size, **FAMILIES[family]).eval()
    shorter = small(depth=kept, memory_block_size=block_size, **FAMILIES[family]).eval()
    with torch.no_grad():
        final, _ = model.forward_intermediates(images(), indices=[kept - 1], stop_early=True)
        model.prune_intermediate_layers([kept - 1], prune_head=False)
        shorter.load_state_dict(model.state_dict())
        torch.testing.assert_close(model(images()), shorter(images()))
        torch.testing.assert_close(final, shorter.forward_features(images()))


def test_batchnorm_values_replace_the_read_layernorm_and_path_dropout_grows_with_depth():
    assert isinstance(small().blocks[0].attn.norm, torch.nn.LayerNorm)  # LayerNorm without affine on every read
    attn = small(value_norm='batchnorm').blocks[0].attn
    assert isinstance(attn.norm, torch.nn.Identity) and type(attn.value[-1]).__name__ == 'TokenBatchNorm'
    assert [layer.attn.read.path_drop for layer in small(depth=3, drop_path_rate=.3).blocks] == pytest.approx(
        [0., .15, .3])


@pytest.mark.parametrize('pool, class_token', [
    (pool, class_token) for pool in ('token', 'avg', 'max', 'avgmax', 'map', 'prr') for class_token in (True, False)
    if class_token or pool != 'token'  # (token pooling without a class token is a bad argument, tested below)
])
def test_every_pooling_of_timms_vit_pools_the_tokens_as_timms_vit_does(pool, class_token):
    """Given the same tokens (register tokens among them) and the same attention-pool weights, the head's input is
    that of timm's ViT built with the same pooling (and ``fc_norm=False``: the tokens are normed before pooling)."""
    kwargs = dict(global_pool=pool, class_token=class_token, reg_tokens=2)
    model = small(**kwargs).eval()
    vit = timm.create_model('vit_tiny_patch16_224', img_size=32, patch_size=4, depth=1, num_classes=10,
                            fc_norm=False, **kwargs).eval()
    assert type(model.attn_pool) is type(vit.attn_pool)
    if model.attn_pool is not None:
        vit.attn_pool.load_state_dict(model.attn_pool.state_dict())
    with torch.no_grad():
        tokens = model.forward_features(images())
        torch.testing.assert_close(model.forward_head(tokens, pre_logits=True),
                                   vit.forward_head(tokens, pre_logits=True))
        torch.testing.assert_close(model.pool(tokens), vit.pool(tokens))


def test_get_intermediate_layers_is_timms_dino_interface():
    """The listed layers' maps with ``reshape``, their prefix tokens (class and register tokens) apart, normed with
    them by ``norm``, as timm's ViT gives them (the last n layers' tokens: tests.helpers.assert_model_contract)."""
    model = small(depth=3, reg_tokens=4).eval()
    x = images()
    with torch.no_grad():
        maps = model.forward_intermediates(x, intermediates_only=True)
        torch.testing.assert_close(model.get_intermediate_layers(x, n=[0, 2], reshape=True), [maps[0], maps[2]])
        (raw, raw_prefix), = model.get_intermediate_layers(x, return_prefix_tokens=True)
        (layer, prefix), = model.get_intermediate_layers(x, return_prefix_tokens=True, norm=True)
        torch.testing.assert_close(torch.cat([prefix, layer], 1), model.norm(torch.cat([raw_prefix, raw], 1)))
    assert layer.shape == (2, 64, 192) and prefix.shape == (2, 5, 192)


def test_reset_classifier_switches_between_attention_pools_and_plain_ones_and_checks_its_arguments():
    model = small(global_pool='map')
    for pool, kind, classes in (('token', type(None), 3), ('prr', AttentionPoolPrr, 4), ('map', AttentionPoolLatent, 5),
                                ('avgmax', type(None), 6)):
        model.reset_classifier(classes, pool)
        assert model.global_pool == pool and type(model.attn_pool) is kind and model(images()).shape == (2, classes)
    with pytest.raises(TypeError, match='num_classes .*got 2.0'):
        model.reset_classifier(2.)
    with pytest.raises(ValueError, match="global_pool .*'token'"):
        small(class_token=False, global_pool='avg').reset_classifier(10, 'token')


@pytest.mark.parametrize('family', FAMILIES)
def test_attention_masks_reach_every_token_attention_as_in_timms_vit(family):
    """``attn_mask`` and ``is_causal`` (timm's ViT's arguments) go to every token attention; reads over depth are per
    token. Causally, no token depends on a later one; a key masked out of every query changes no other token. Both
    together are refused (timm's non-fused attention would drop the mask): pass one, or fold them into attn_mask."""
    model = small(.5, **FAMILIES[family]).eval()
    x = images()
    later = x + 1.  # other patches after the first two (tokens 1 and 2), which stay
    later[..., :4, :8] = x[..., :4, :8]
    n = 1 + 64
    with torch.no_grad():
        tokens = model.forward_features(x)
        torch.testing.assert_close(model.forward_features(x, attn_mask=torch.ones(n, n, dtype=torch.bool)), tokens)
        causal = model.forward_features(x, is_causal=True)
        torch.testing.assert_close(model.forward_features(x, attn_mask=torch.ones(n, n).tril().bool()), causal)
        torch.testing.assert_close(model.forward_features(later, is_causal=True)[:, :3], causal[:, :3])
        assert not torch.allclose(model.forward_features(later)[:, :3], tokens[:, :3])
        unseen = torch.ones(n, n, dtype=torch.bool)
        unseen[:, 3:] = False  # every token attends only to the class token and the first two patches
        unseen[3:, 3:] = torch.eye(n - 3, dtype=torch.bool)  # and to itself
        masked = model.forward_features(x, attn_mask=unseen)
        torch.testing.assert_close(model.forward_features(later, attn_mask=unseen)[:, :3], masked[:, :3])
        torch.testing.assert_close(model.forward_intermediates(x, attn_mask=unseen)[0], masked)
        for call in (model, model.forward_features, model.forward_intermediates):
            with pytest.raises(ValueError, match='attn_mask and is_causal'):
                call(x, attn_mask=unseen, is_causal=True)


@pytest.mark.parametrize('family', FAMILIES)
def test_qk_norm_normalises_every_token_attentions_queries_and_keys_as_in_timms_vit(family):
    """``qk_norm=True``: the token attention is timm's, with the per-head LayerNorms of timm's ViT on q and k."""
    vit = timm.create_model('vit_tiny_patch16_224', depth=1, qk_norm=True).blocks[0].attn
    model, plain = small(**FAMILIES[family], qk_norm=True), small(**FAMILIES[family])
    attn = sublayers(model)[0].body
    assert type(attn) is type(vit) and type(attn.q_norm) is type(vit.q_norm) and type(attn.k_norm) is type(vit.k_norm)
    assert (attn.q_norm.normalized_shape, attn.k_norm.eps) == ((64,), 1e-6)
    attn = 'attn' if family == 'attnres' else 'attn.body'
    assert {n for n, _ in model.named_parameters()} - {n for n, _ in plain.named_parameters()} == \
        {f'blocks.{i}.{attn}.{qk}_norm.{p}' for i in range(2) for qk in 'qk' for p in ('weight', 'bias')}


def test_register_tokens_follow_the_class_token_with_positions_and_every_token_attention_sees_them():
    """Left out of pooling and of the feature maps: tests of pooling and get_intermediate_layers above."""
    model = small(reg_tokens=4, global_pool='avg').eval()
    assert model.num_prefix_tokens == 5 and model.pos_embed.shape == (1, 5 + 64, 192)
    with torch.no_grad():
        assert model.forward_features(images()).shape == (2, 5 + 64, 192)
        out = model(images())
        model.reg_token.normal_()
        assert not torch.allclose(model(images()), out)  # every token attention sees them
    model.set_input_size(img_size=(32, 48))
    assert model.pos_embed.shape == (1, 5 + 8 * 12, 192) and model(torch.randn(1, 3, 32, 48)).shape == (1, 10)


# --- every input a user may give -----------------------------------------------------------------------------------

@pytest.mark.parametrize('option', ['default', 'batchnorm_values', 'null_entry', 'attnres', 'block_attnres'])
def test_every_batch_gives_the_logits_of_its_images(option):
    """Half precision: within 1 % (bf16) and 0.13 % (fp16) of float32 when written; AttnRes 2.8 % and 0.5 %."""
    assert_every_batch_gives_the_logits_of_its_images(lambda: small(.5, **OPTIONS[option]),
                                                      half_tolerance=4 if 'attnres' in option else 1)


@pytest.mark.parametrize('kwargs, error, named', [  # a count, a rate, a choice; arguments that do not fit together
    (dict(memory_block_size=2.5), TypeError, 'memory_block_size .*got 2.5'),
    (dict(key_dim=0), ValueError, 'key_dim .*got 0'),
    (dict(attn_drop_rate=-.1), ValueError, 'attn_drop_rate .*got -0.1'),
    (dict(mlp_ratio=0), ValueError, 'mlp_ratio'),
    (dict(depth_kernel='cosine'), ValueError, "depth_kernel .*got 'cosine'"),
    (dict(global_pool='gem'), ValueError, "global_pool .*got 'gem'"),
    (dict(num_heads=5), ValueError, r'num_heads .*embed_dim \(192\), got 5'),
    (dict(depth_num_heads=5), ValueError, r'depth_num_heads .*key_dim \(64\)'),
    (dict(class_token=False), ValueError, 'global_pool .*without a class token'),
    (dict(keys_from_values=True, key_dim=64), ValueError, 'key_dim .*keys_from_values'),
    (dict(keys_from_values=True, key_norm=True), ValueError, 'key_norm .*keys_from_values'),
    (dict(init_values=1e-5), ValueError, 'init_values .*sublayer_values'),
    (dict(ATTNRES, init_values=0.), ValueError, 'init_values .*got 0.0'),
    # timm's ViT arguments without a counterpart: the position embedding a memory entry, the blocks its own
    *((dict.fromkeys([name], 1), TypeError, name) for name in ('pos_embed', 'fc_norm', 'block_fn')),
])
def test_a_bad_argument_raises_naming_it_and_its_value(kwargs, error, named):
    with pytest.raises(error, match=named):
        small(**kwargs)


@pytest.mark.parametrize('options', [
    {}, dict(global_pool='map'), dict(depth_kernel='gaussian', null_entry=True, reg_tokens=2), ATTNRES,
], ids=['default', 'map_pool', 'gaussian_null_registers', 'attnres'])
def test_layer_decay_and_weight_decay_treat_each_parameter_as_timms_vit_does(options):
    """Layer decay scales the stem as timm's ViT scales its embeddings, block i as its block i, the last read as its
    final norm and the head (and attention pool) as its head; weight decay spares embeddings, tokens, null entry,
    biases, norms, depth-attention queries and Gaussian widths, and decays every other matrix."""
    def settings(model: torch.nn.Module) -> dict:
        optimizer = create_optimizer_v2(model, 'adamw', lr=1e-3, weight_decay=.05, layer_decay=.75)
        group_of = {id(p): (g['lr_scale'], g['weight_decay']) for g in optimizer.param_groups for p in g['params']}
        return {name: group_of[id(p)] for name, p in model.named_parameters()}

    model = small(**options)
    vit = timm.create_model('vit_tiny_patch16_224', depth=2, img_size=32, patch_size=4, num_classes=10,
                            global_pool='map')
    vit_scales = {name: scale for name, (scale, _) in settings(vit).items()}
    assert len(set(vit_scales.values())) == 4  # stem, two blocks, head
    ours = settings(model)
    for name, (scale, decay) in ours.items():
        part = name.split('.')[0]
        expected = f'blocks.{name.split(".")[1]}.norm1.weight' if part == 'blocks' else {
            'read_out': 'norm.weight', 'norm': 'norm.weight', 'head': 'head.weight', 'attn_pool': 'head.weight',
        }.get(part, 'pos_embed')
        assert scale == pytest.approx(vit_scales[expected]), name
        spared = part in ('cls_token', 'reg_token', 'pos_embed', 'null_key', 'null_value') or name.endswith(
            ('.query', '.log_gamma', '.bias')) or model.get_parameter(name).ndim == 1
        assert decay == (0. if spared else .05), name
    assert {n for n in ours if n.endswith(('.query', '.log_gamma'))} <= model.no_weight_decay()
    assert any(n.endswith('.log_gamma') for n in ours) == ('gaussian' in options.values())


# --- checkpoints, sizes and weights ---------------------------------------------------------------------------------

@pytest.mark.parametrize('case', ['vit_qimia_default', 'vit_qimia_options'])
def test_checkpoints_of_timm_hbf_0_1_load_and_give_their_logits(case):
    name, kwargs, state_dict, x, logits = legacy_checkpoint(case)
    model = timm.create_model(name, **kwargs).eval()
    model.load_state_dict(checkpoint_filter_fn(state_dict, model), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(model(x), logits, rtol=0, atol=1e-5)


def name_in_timm_hbf_0_2(name: str) -> str:
    """How timm_hbf 0.2 named an AttnRes parameter: each sublayer as QIMIA's, its timm module under ``body``."""
    parts = name.split('.')
    if parts[0] != 'blocks' or parts[2] in ('attn', 'mlp'):
        return '.'.join(parts[:2] + [parts[2], 'body'] + parts[3:]) if parts[0] == 'blocks' else name
    sublayer = 'attn' if parts[2].endswith('1') else 'mlp'
    part = {'read': 'read', 'norm': 'norm', 'key': 'key', 'value_norm': 'value'}[parts[2][:-1]]
    return '.'.join(parts[:2] + [sublayer, part] + parts[3:])


@pytest.mark.parametrize('name', ['vit_attnres_tiny', 'vit_attnres_block_tiny'])
def test_checkpoints_of_timm_hbf_0_2_attnres_load_and_give_their_logits(name, tmp_path):
    """A train.py checkpoint of 0.2 AttnRes, as ``pretrained_cfg_overlay=dict(file=...)`` takes it."""
    kwargs = dict(depth=2, value_norm='batchnorm', keys_from_values=False)
    torch.manual_seed(0)
    model = timm.create_model(name, **kwargs).eval()
    randomize_queries(model)
    old = {name_in_timm_hbf_0_2(k): v for k, v in model.state_dict().items()}
    assert 'blocks.1.attn.body.qkv.weight' in old and 'blocks.1.mlp.value.norm.running_mean' in old
    torch.save({'state_dict': old}, tmp_path / 'last.pth.tar')
    loaded = timm.create_model(name, **kwargs, pretrained=True,
                               pretrained_cfg_overlay=dict(file=str(tmp_path / 'last.pth.tar'))).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(images()), model(images()), rtol=0, atol=0)


def test_dynamic_img_size_on_square_and_non_square_grids_and_padding_to_whole_patches():
    """``dynamic_img_size`` resamples the position embedding from the model's own grid, square or not: at its size the
    static model. ``dynamic_img_pad`` pads 30 x 30 at patch 4 with zeros to 32 x 32, as timm's ViT does."""
    for img_size in (32, (32, 48)):
        height, width = (img_size, img_size) if isinstance(img_size, int) else img_size
        x = torch.randn(2, 3, height, width, generator=torch.Generator().manual_seed(0))
        static, dynamic = small(img_size=img_size).eval(), small(img_size=img_size, dynamic_img_size=True).eval()
        with torch.no_grad():
            torch.testing.assert_close(dynamic(x), static(x), rtol=0, atol=0)
            for size in ((40, 40), (48, 32)):
                assert dynamic(torch.randn(2, 3, *size)).shape == (2, 10)
    x = images(size=30)
    padded = F.pad(x, (0, 2, 0, 2))
    for model in (small(dynamic_img_size=True, dynamic_img_pad=True),
                  timm.create_model('vit_tiny_patch16_224', img_size=32, patch_size=4, depth=2, dynamic_img_size=True,
                                    dynamic_img_pad=True)):
        with torch.no_grad():
            torch.testing.assert_close(model.eval()(x), model(padded), rtol=0, atol=0)


def test_weight_init_skip_leaves_the_layers_as_pytorch_built_them():
    """No ViT init (trunc-normal at std 0.02): PyTorch's (std 1 / sqrt(3 fan_in), 0.042 at width 192)."""
    def linear_std(model: torch.nn.Module) -> float:
        return torch.cat([m.weight.flatten() for m in model.modules() if isinstance(m, torch.nn.Linear)]).std().item()

    assert linear_std(small()) == pytest.approx(.02, rel=.1)
    assert linear_std(small(weight_init='skip')) > .035


def test_a_resize_is_saved_for_the_hub_as_timm_s_vit_saves_it(tmp_path):
    """timm's save_for_hf writes the size set_input_size gave a ViT, for the repo to rebuild it; QIMIA's alike."""
    def saved(model: torch.nn.Module, folder: str):
        model.eval().set_input_size(img_size=48, patch_size=8)
        save_for_hf(model, tmp_path / folder)
        config = json.loads((tmp_path / folder / 'config.json').read_text())
        return config['pretrained_cfg']['input_size'][1:], config.get('model_args', {}).get('img_size')

    qimia = small(depth=1)
    assert saved(qimia, 'qimia') == saved(timm.create_model('vit_tiny_patch16_224', img_size=32, patch_size=4,
                                                             depth=1), 'vit') == ([48, 48], [48, 48])
    pulled = timm.create_model(f'local-dir:{tmp_path / "qimia"}', pretrained=True).eval()
    x = torch.randn(1, 3, 48, 48)
    assert torch.equal(pulled(x), qimia(x))


def test_the_checkpoint_filter_resamples_position_and_patch_embeddings_to_the_model():
    """As timm's ViT resamples them (resample_abs_pos_embed, resample_patch_embed), also into a grid of as many
    positions but another shape (the shipped weights' 8 x 8 into 16 x 4); the rest as it is."""
    trained = small(depth=1).state_dict()
    model = small(depth=1, img_size=64, patch_size=8)
    state_dict = checkpoint_filter_fn(trained, model)
    torch.testing.assert_close(state_dict['patch_embed.proj.weight'], resample_patch_embed(
        trained['patch_embed.proj.weight'], [8, 8]), rtol=0, atol=0)
    assert all(torch.equal(state_dict[k], v) for k, v in trained.items() if k != 'patch_embed.proj.weight')
    model = timm.create_model('vit_qimia_tiny', pretrained=True, img_size=(64, 16))
    expected = resample_abs_pos_embed(load_file(model.pretrained_cfg['file'])['pos_embed'], new_size=[16, 4],
                                      old_size=[8, 8], num_prefix_tokens=1)
    assert torch.equal(model.pos_embed.detach(), expected.float())


# --- every execution mode ---------------------------------------------------------------------------------------------

DEPTH_FAMILIES = dict(FAMILIES, block_attnres=dict(ATTNRES, memory_block_size=4), every_option=ALL_OPTIONS)


def logits_and_gradients(run, model, x):
    torch.manual_seed(0)
    logits = run(x)
    logits.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return logits.detach(), grads


@pytest.mark.slow
@pytest.mark.parametrize('mode', EXECUTION_MODES)
@pytest.mark.parametrize('family', DEPTH_FAMILIES)
def test_every_execution_mode_gives_the_eager_logits_and_gradients(family, mode):
    """Compiled whole, by region or past a graph break (aot_eager), and exported: the eager logits and gradients
    within float32 rounding (the shipped weights under inductor: tests/models/test_shipped_weights.py)."""
    torch._dynamo.reset()
    model = small(.05, depth=3, **DEPTH_FAMILIES[family]).eval()  # no dropout: the same function in every run
    logits, grads = logits_and_gradients(model, model, images(3))
    got, got_grads = logits_and_gradients(run_as(mode, model, images(3), 'aot_eager'), model, images(3))
    torch.testing.assert_close(got, logits, rtol=0, atol=1e-5)
    largest = max(grad.abs().max().item() for grad in grads.values())
    for name, grad in grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-5 * largest, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize('option', OPTIONS)
def test_every_option_compiles_whole_scripts_traces_and_exports(option):
    """torch.compile(fullgraph=True), with --grad-checkpointing too (aot_eager), gives the eager outputs, loss and
    gradients; TorchScript (with an attention mask), torch.fx and torch.export give the eager outputs."""
    for checkpointing in (False, True):
        torch._dynamo.reset()
        model = small(**OPTIONS[option])
        model.set_grad_checkpointing(checkpointing)
        randomize_queries(model)
        compiled_matches_eager(model, images(), 'aot_eager')
    model.set_grad_checkpointing(False)
    model.eval()
    mask = torch.ones(64 + model.num_prefix_tokens, 64 + model.num_prefix_tokens).tril().bool()
    with torch.no_grad():
        torch.testing.assert_close(torch.jit.script(model)(images(), attn_mask=mask), model(images(), attn_mask=mask))
        torch.testing.assert_close(torch.fx.symbolic_trace(model)(images()), model(images()))
        torch.testing.assert_close(run_as('exported', model, images(3))(images(3)), model(images(3)))


@pytest.mark.slow
@pytest.mark.parametrize('family', FAMILIES)
def test_compiles_whole_with_inductor(family):
    torch._dynamo.reset()
    narrow = dict(embed_dim=48, num_heads=3, **({} if family == 'attnres' else dict(key_dim=16, depth_num_heads=2)))
    model = small(depth=1, num_classes=2, **FAMILIES[family], **narrow)
    randomize_queries(model)
    compiled_matches_eager(model, images(), 'inductor')


@pytest.mark.slow
@pytest.mark.parametrize('family', FAMILIES)
def test_double_backward_passes_gradgradcheck_in_float64(family):
    """Through a whole tiny model: its queries and the first layer's key and value paths or feed-forward block (on
    timm's reference attention path: its fused one has no double backward)."""
    sizes = dict(depth=1, embed_dim=12, num_heads=2, img_size=8, patch_size=4, num_classes=3, mlp_ratio=1.)
    model = small(**sizes, **(dict(key_dim=8, depth_num_heads=2) if family == 'qimia' else ATTNRES)).double().eval()
    for module in model.modules():
        if isinstance(module, Attention):
            module.fused_attn = False
    randomize_queries(model)
    names = [n for n, _ in model.named_parameters() if n.endswith('query') or '.mlp.' in n and 'fc1' not in n
             or '.attn.key.' in n or '.attn.value.' in n]
    params = dict(model.named_parameters())
    x = torch.randn(1, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert torch.autograd.gradgradcheck(lambda *v: torch.func.functional_call(model, dict(zip(names, v)), (x,)),
                                        [params[n].detach().requires_grad_() for n in names])
