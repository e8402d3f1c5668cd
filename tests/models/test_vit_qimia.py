"""The QIMIA ViT family: depth attention in place of residuals, the report's options, diagnostics and timm's API."""
import gc
import weakref

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.optim import create_optimizer_v2

import timm_hbf  # noqa: F401  (registers the models)
from tests.helpers import ShapeRecorder, compiled_matches_eager, legacy_checkpoint, saved_activation_bytes
from timm_hbf.models.vit_qimia import VisionTransformerQimia

NAMES = [
    'vit_qimia_base', 'vit_qimia_base_patch16_224', 'vit_qimia_small', 'vit_qimia_small_patch16_224',
    'vit_qimia_surf23_patch8_32', 'vit_qimia_tiny', 'vit_qimia_tiny_patch16_224',
]

OPTIONS = {
    'default': {},
    'key_dim': dict(key_dim=32),
    'depth_heads': dict(depth_num_heads=2),
    'key_norm': dict(key_norm=True),
    'batchnorm_values': dict(value_norm='batchnorm'),
    'gaussian_depth_attention': dict(depth_kernel='gaussian'),
    'path_dropout': dict(drop_path_rate=.2),
    'null_entry': dict(null_entry=True),
    'block_memory': dict(memory_block_size=3),
    'avg_pool': dict(global_pool='avg', class_token=False),
}
# every option away from its default, in one model
ALL_OPTIONS = dict(
    key_dim=32, key_norm=True, value_norm='batchnorm', depth_kernel='gaussian', drop_path_rate=.2, null_entry=True,
    memory_block_size=2, global_pool='avg', class_token=False,
)
NARROW = dict(embed_dim=48, num_heads=3, key_dim=16, depth_num_heads=2)


def small(**kwargs) -> VisionTransformerQimia:
    """A two-layer vit_qimia_tiny (unless told otherwise), for speed."""
    torch.manual_seed(0)
    return timm.create_model('vit_qimia_tiny', **dict(dict(depth=2), **kwargs))


def images(batch: int = 2, size: int = 32) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(0))


def randomize_queries(model: torch.nn.Module, std: float = .5) -> None:
    """Queries start at zero, where keys get no gradient; a trained model's queries are not."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith('query'):
                p.copy_(torch.randn(p.shape, generator=g) * std)


# --- registry and configurations ------------------------------------------------------------------------------------

def test_registered_names():
    assert timm.list_models('vit_qimia*') == NAMES
    assert timm.list_models(module='vit_qimia') == NAMES
    assert timm.list_pretrained('vit_qimia*') == []


@pytest.mark.parametrize('name, size, patch, width, depth, heads, key_dim, depth_heads', [
    ('vit_qimia_tiny', 32, 4, 192, 12, 3, 64, 8),
    ('vit_qimia_small', 32, 4, 384, 12, 6, 128, 16),
    ('vit_qimia_base', 32, 4, 768, 12, 12, 256, 32),
    ('vit_qimia_tiny_patch16_224', 224, 16, 192, 12, 3, 64, 8),
    ('vit_qimia_small_patch16_224', 224, 16, 384, 12, 6, 128, 16),
    ('vit_qimia_base_patch16_224', 224, 16, 768, 12, 12, 256, 32),
])
def test_configurations(name, size, patch, width, depth, heads, key_dim, depth_heads):
    model = timm.create_model(name, device='meta')
    assert model.pretrained_cfg['input_size'] == (3, size, size)
    assert model.patch_embed.patch_size == (patch, patch)
    layer = model.blocks[0]
    assert (model.embed_dim, len(model.blocks), layer.attn.body.num_heads) == (width, depth, heads)
    assert layer.attn.read.query.shape == (depth_heads, key_dim // depth_heads)


def test_report_configuration():
    """SURF report appendix: embed 256, depth 10, patch 8, FF hidden 1024, key dim 256 (32 heads of 8)."""
    model = timm.create_model('vit_qimia_surf23_patch8_32', device='meta')
    layer = model.blocks[0]
    assert (model.embed_dim, len(model.blocks), model.patch_embed.patch_size) == (256, 10, (8, 8))
    assert layer.mlp.body[0].out_features == 1024
    assert layer.attn.read.query.shape == (32, 8)
    assert model.num_memory_entries == 22  # patch and position embeddings, then two entries per layer
    assert model.num_classes == 10


def test_blocks_follow_the_report():
    layer = small().blocks[0]
    assert [type(m).__name__ for m in layer.attn.key] == ['PReLULinear', 'DepthKey']
    assert [type(m).__name__ for m in layer.attn.value] == ['PReLULinear', 'Identity']
    assert layer.mlp.key[0].slope is not layer.mlp.value[0].slope  # separate PReLUs after the shared hidden layer
    assert layer.mlp.key[0].in_features == layer.mlp.value[0].in_features == layer.mlp.body[0].out_features
    assert not any(isinstance(m, torch.nn.LayerNorm) and m.elementwise_affine for m in layer.modules())


# --- depth attention at init ----------------------------------------------------------------------------------------

def test_every_block_reads_the_uniform_average_of_all_entries_at_init():
    """Zero queries: each block's input is LayerNorm(mean of every entry written before it), to 1e-5."""
    model = small(depth=3).eval()
    entries, inputs = [], []
    model.patch_value_norm.register_forward_hook(lambda m, i, o: entries.append(o))
    model.pos_value_norm.register_forward_hook(lambda m, i, o: entries.append(o.expand(2, -1, -1)))
    for layer in model.blocks:
        for block in (layer.attn, layer.mlp):
            block.body.register_forward_pre_hook(lambda m, i: inputs.append((len(entries), i[0])))
            block.value.register_forward_hook(lambda m, i, o: entries.append(o))
    with torch.no_grad():
        model(images())
    assert len(inputs) == 6 and len(entries) == 8
    for num_seen, block_input in inputs:
        expected = F.layer_norm(torch.stack(entries[:num_seen]).mean(0), (192,), eps=1e-6)
        # float32 rounding of the weighted sum (weights 1/L) against stack().mean(): a few 1e-7
        torch.testing.assert_close(block_input, expected, rtol=0, atol=1e-5)


def test_stats_at_init_show_uniform_reads():
    model = small(depth=2)
    stats = model.depth_attention_stats(images())
    assert stats['readers'] == ['0.attn', '0.mlp', '1.attn', '1.mlp', 'out']
    assert stats['entries'] == ['patch', 'pos', '0.attn', '0.mlp', '1.attn', '1.mlp']
    matrix = stats['matrix']
    assert matrix.shape == (5, 6)
    for row, seen in enumerate([2, 3, 4, 5, 6]):
        torch.testing.assert_close(matrix[row, :seen], torch.full((seen,), 1 / seen))
        assert matrix[row, seen:].isnan().all()
    torch.testing.assert_close(stats['entropy'], torch.ones(5))
    assert (stats['query_norm'] == 0).all()
    assert model.training  # the model's mode is kept


def test_gaussian_reads_at_init_are_uniform_only_with_unit_keys():
    """Zero queries with the Gaussian kernel weigh entries by exp(-gamma ||k||^2): uniform where every key has the
    same norm (key_norm=True), favouring short keys otherwise."""
    x = images()
    unit = small(depth_kernel='gaussian', key_norm=True).depth_attention_stats(x)
    torch.testing.assert_close(unit['entropy'], torch.ones(5))
    raw = small(depth_kernel='gaussian').depth_attention_stats(x)['matrix']
    seen = raw.isfinite().sum(1, keepdim=True)
    assert ((raw * seen - 1).abs().nan_to_num(0).amax(1) > .03).all()  # mean weights 3 % or more off 1 / seen


def test_stats_follow_trained_queries():
    model = small(depth=2)
    randomize_queries(model, std=3.)
    stats = model.depth_attention_stats(images())
    assert (stats['entropy'] < .99).all()
    assert (stats['query_norm'] > 0).all()
    torch.testing.assert_close(stats['matrix'].nansum(1), torch.ones(5))


def test_stats_work_with_float64_as_the_default_dtype():
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = small()
        stats = model.depth_attention_stats(images().double())
    finally:
        torch.set_default_dtype(default)
    assert stats['matrix'].dtype == stats['entropy'].dtype == torch.float32
    torch.testing.assert_close(stats['entropy'], torch.ones(5))


@pytest.mark.parametrize('autocast', [False, True])
def test_stats_work_in_bf16(autocast):
    model = small()
    randomize_queries(model)
    expected = model.depth_attention_stats(images())
    x = images()
    if not autocast:
        model, x = model.to(torch.bfloat16), x.to(torch.bfloat16)
    with torch.autocast('cpu', dtype=torch.bfloat16, enabled=autocast):
        stats = model.depth_attention_stats(x)
    assert stats['matrix'].dtype == torch.float32
    torch.testing.assert_close(stats['matrix'], expected['matrix'], rtol=0, atol=.02, equal_nan=True)
    torch.testing.assert_close(stats['entropy'], expected['entropy'], rtol=0, atol=.02)


# --- block memory ---------------------------------------------------------------------------------------------------

def test_block_memory_reads_the_stem_the_finished_summaries_and_the_current_one():
    """memory_block_size 3: blocks 0-2 and 3-5 form two summaries (values summed, keys averaged); every read,
    with trained queries, is Eq. 1-2 over the stem's entries, the finished summaries and the current summary."""
    model = small(depth=3, memory_block_size=3).eval()
    randomize_queries(model)
    stem, written, reads = [], [], []  # (key, value) pairs; reads: (block, its input)
    model.patch_key.register_forward_hook(lambda m, i, o: stem.append([o]))
    model.patch_value_norm.register_forward_hook(lambda m, i, o: stem[-1].append(o))
    model.pos_key.register_forward_hook(lambda m, i, o: stem.append([o.expand(2, -1, -1)]))
    model.pos_value_norm.register_forward_hook(lambda m, i, o: stem[-1].append(o.expand(2, -1, -1)))
    blocks = [block for layer in model.blocks for block in (layer.attn, layer.mlp)]
    for block in blocks:
        block.body.register_forward_pre_hook(lambda m, i, block=block: reads.append((block, i[0])))
        block.key.register_forward_hook(lambda m, i, o: written.append([o]))
        block.value.register_forward_hook(lambda m, i, o: written[-1].append(o))
    with torch.no_grad():
        model(images())

    def summary(members):
        return torch.stack([k for k, _ in members]).mean(0), torch.stack([v for _, v in members]).sum(0)

    def read(block, entries):
        q = block.read.query  # (H, dk)
        keys = torch.stack([k for k, _ in entries]).unflatten(-1, (q.shape[0], -1))  # (L, B, N, H, dk)
        weights = (keys * q).sum(-1).softmax(0).unsqueeze(-1)
        values = torch.stack([v for _, v in entries]).unflatten(-1, (q.shape[0], -1))
        return F.layer_norm((weights * values).sum(0).flatten(-2), (192,), eps=1e-6)

    assert len(reads) == 6
    for b, (block, block_input) in enumerate(reads):
        first = b - b % 3  # the current memory block starts here
        finished = [summary(written[g:g + 3]) for g in range(0, first, 3)]
        current = [summary(written[first:b])] if b > first else []
        torch.testing.assert_close(block_input, read(block, stem + finished + current), rtol=0, atol=1e-5)


def test_block_memory_stats_show_which_summaries_each_read_sees():
    model = small(depth=2, memory_block_size=2)
    stats = model.depth_attention_stats(images())
    seen = stats['matrix'].isfinite()
    #                          patch  pos    0.attn 0.mlp  1.attn 1.mlp
    assert seen.tolist() == [[True, True, False, False, False, False],  # 0.attn
                             [True, True, True, False, False, False],   # 0.mlp: the summary of block 0 so far
                             [True, True, False, True, False, False],   # 1.attn: the finished summary
                             [True, True, False, True, True, False],    # 1.mlp
                             [True, True, False, True, False, True]]    # out
    torch.testing.assert_close(stats['matrix'].nansum(1), torch.ones(5))
    torch.testing.assert_close(stats['entropy'], torch.ones(5))


# --- memory ---------------------------------------------------------------------------------------------------------

def test_reads_never_stack_the_entries():
    """No tensor of the forward or backward pass holds several entries' values (the largest are the feed-forward
    hidden activations): reads accumulate entry by entry."""
    model = small(depth=4)  # 10 entries: a stack of values would be 2.5x the hidden activations
    randomize_queries(model)
    x = images()
    with ShapeRecorder() as recorder:
        model(x).sum().backward()
    hidden = x.shape[0] * 65 * 768
    assert max(shape.numel() for shape in recorder.shapes) <= hidden


def test_reads_match_plain_autograd(monkeypatch):
    """The reads' hand-written backward pass gives every parameter the gradient plain autograd gives."""
    from timm_hbf.layers import depth_attention

    model = small(depth=2, null_entry=True).double()
    randomize_queries(model)
    x = images().double()
    model(x).sum().backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    monkeypatch.setattr(depth_attention, 'depth_attend', depth_attention._read)
    model(x).sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(ours[name], p.grad, msg=name)


def test_saved_activations_grow_linearly_with_depth():
    """Every layer adds the same bytes to what the backward pass keeps: reads keep no weights (L x tokens x heads,
    which would grow with the square of the depth) and share the entries they read."""
    x = images()
    saved = [saved_activation_bytes(small(depth=depth), x) for depth in (2, 4, 6)]
    assert saved[2] - saved[1] == saved[1] - saved[0] > 0


def test_training_keeps_nothing_outside_saved_tensor_hooks():
    """With hooks that keep copies of what autograd saves, every entry that the blocks wrote is freed after the
    forward pass (nothing holds it on the side, e.g. on a Function's ctx), and the gradients are unchanged: what
    activation offloading sees is all there is."""
    model = small(depth=2)
    randomize_queries(model)
    x = images()
    model(x).sum().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    written = []
    for layer in model.blocks:
        for block in (layer.attn, layer.mlp):
            block.key.register_forward_hook(lambda m, i, o: written.append(weakref.ref(o)))
            block.value.register_forward_hook(lambda m, i, o: written.append(weakref.ref(o)))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        out = model(x)
    gc.collect()
    assert len(written) == 8 and all(ref() is None for ref in written)
    out.sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], msg=name)


def test_save_on_cpu_gives_the_same_gradients():
    model = small(depth=2)
    randomize_queries(model)
    x = images()
    model(x).sum().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with torch.autograd.graph.save_on_cpu():
        loss = model(x).sum()
    loss.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], msg=name)


def test_block_memory_frees_merged_entries_in_inference():
    """memory_block_size 2: a block's own value is freed once merged into its summary, and the output read sees
    the stem's entries and one summary per memory block."""
    model = small(depth=3, memory_block_size=2).eval()
    written = []
    for layer in model.blocks:
        for block in (layer.attn, layer.mlp):
            block.value.register_forward_hook(lambda m, i, o: written.append(weakref.ref(o)))
    seen, alive = [], []

    def at_output_read(module, args):
        gc.collect()
        seen.append(len(args[1]))
        alive.extend(ref() is not None for ref in written)

    model.read_out.register_forward_pre_hook(at_output_read)
    with torch.no_grad():
        model(images())
    assert seen == [2 + 3]
    assert alive == [False] * 6


@pytest.mark.parametrize('option', ['default', 'path_dropout', 'gaussian_depth_attention', 'block_memory'])
def test_grad_checkpointing_gives_identical_outputs_and_gradients(option):
    model = small(**dict(OPTIONS[option], depth=3))
    randomize_queries(model)
    x = images()
    torch.manual_seed(2)  # the same dropout masks in both runs
    out = model(x)
    out.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.set_grad_checkpointing(True)
    torch.manual_seed(2)
    out_ckpt = model(x)
    out_ckpt.sum().backward()
    torch.testing.assert_close(out_ckpt, out, rtol=0, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=0, atol=0, msg=name)


def test_bf16_autocast_trains():
    model = small()
    randomize_queries(model)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out = model(images())
    out.float().sum().backward()
    assert torch.isfinite(out.float()).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize('kwargs', [{}, dict(class_token=False, global_pool='avg')])
def test_under_bf16_autocast_reads_and_summaries_are_float32_with_or_without_class_token(kwargs):
    """Reads accumulate and block-memory summaries add up in float32 under autocast, and the patch entry has the
    dtype of every other block output, whether or not a class token is concatenated to it."""
    model = small(memory_block_size=2, **kwargs)
    reads, patch_entry = [], []
    for layer in model.blocks:
        for block in (layer.attn, layer.mlp):
            block.read.register_forward_hook(lambda m, i, o: reads.append((o.dtype, [v.dtype for v in i[1]])))
    model.patch_value_norm.register_forward_hook(lambda m, i, o: patch_entry.append(o.dtype))
    with torch.autocast('cpu', dtype=torch.bfloat16):
        model(images())
    assert patch_entry == [torch.bfloat16]
    assert [dtype for dtype, _ in reads] == [torch.float32] * 4
    # before the second layer's first read: the stem, then the summary of the first layer's two blocks
    assert reads[2][1] == [torch.bfloat16, torch.float32, torch.float32]


# --- options --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('option', OPTIONS)
def test_option_trains_a_step_with_a_gradient_for_every_parameter(option):
    model = small(**OPTIONS[option])
    randomize_queries(model)
    optimizer = create_optimizer_v2(model, 'adamw', lr=1e-3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = F.cross_entropy(model(images(4)), torch.tensor([0, 1, 2, 3]))
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing
    optimizer.step()
    assert torch.isfinite(loss)
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())


@pytest.mark.parametrize('option', OPTIONS)
def test_option_passes_the_model_contract(option):
    """TorchScript and fx give the eager outputs; intermediates, features and pruning work."""
    model = small(**OPTIONS[option]).eval()
    randomize_queries(model)
    x = images()
    with torch.no_grad():
        out = model(x)
        scripted = torch.jit.script(model)
        torch.testing.assert_close(scripted(x), out)
        traced = torch.fx.symbolic_trace(model)
        torch.testing.assert_close(traced(x), out)
        final, intermediates = model.forward_intermediates(x)
        torch.testing.assert_close(model.forward_head(final), out)
    assert [y.shape for y in intermediates] == [(2, 192, 8, 8)] * 2
    features = timm.create_model('vit_qimia_tiny', depth=2, features_only=True, out_indices=(0, 1),
                                 **OPTIONS[option]).eval()
    assert [f.shape for f in features(x)] == [(2, 192, 8, 8)] * 2
    assert model.prune_intermediate_layers([0]) == [0]
    assert len(model.blocks) == 1 and model.num_memory_entries == model.num_stem_entries + 2
    assert model(x).shape[-1] == 192  # head pruned: unpooled tokens


def test_null_entry_is_read_first():
    model = small(null_entry=True)
    assert model.memory_entry_names()[:3] == ['null', 'patch', 'pos']
    assert {'null_key', 'null_value'} <= model.no_weight_decay()


def test_batchnorm_values_replace_the_read_layernorm():
    assert small().blocks[0].attn.read.norm_eps == 1e-6  # LayerNorm without affine on every read
    model = small(value_norm='batchnorm')
    assert model.blocks[0].attn.read.norm_eps == 0.  # no norm on reads
    assert type(model.blocks[0].attn.value[-1]).__name__ == 'TokenBatchNorm'


def test_path_dropout_grows_with_depth():
    model = small(depth=3, drop_path_rate=.3)
    assert [layer.attn.read.path_drop for layer in model.blocks] == pytest.approx([0., .15, .3])


def test_gaussian_depth_attention_uses_the_hyperbf_kernel():
    from timm_hbf.layers import HyperBFKernel

    read = small(depth_kernel='gaussian').blocks[0].attn.read
    assert isinstance(read.kernel, HyperBFKernel) and read.kernel.log_gamma.numel() == 8


@pytest.mark.parametrize('kwargs, message', [
    (dict(value_norm='rmsnorm'), "Unknown value_norm 'rmsnorm'"),
    (dict(depth_kernel='cosine'), "Unknown depth-attention kernel 'cosine'"),
    (dict(depth_num_heads=5), 'depth_num_heads among their common divisors'),
    (dict(memory_block_size=0), 'memory_block_size must be at least 1'),
])
def test_bad_arguments_name_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message):
        small(**kwargs)


# --- optimizer integration ------------------------------------------------------------------------------------------

def test_queries_are_not_decayed_and_layer_decay_covers_every_parameter():
    model = small()
    assert {n for n, _ in model.named_parameters() if n.endswith('query')} <= model.no_weight_decay()
    optimizer = create_optimizer_v2(model, 'adamw', lr=1e-3, weight_decay=.05, layer_decay=.75)
    grouped = sum(p.numel() for g in optimizer.param_groups for p in g['params'])
    assert grouped == sum(p.numel() for p in model.parameters())


# --- checkpoints ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('case', ['vit_qimia_default', 'vit_qimia_options'])
def test_checkpoints_of_timm_hbf_0_1_load_and_give_their_logits(case):
    name, kwargs, state_dict, x, logits = legacy_checkpoint(case)
    model = timm.create_model(name, **kwargs).eval()
    model.load_state_dict(state_dict, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(model(x), logits, rtol=0, atol=1e-5)


# --- torch.compile --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('options', [{}, ALL_OPTIONS], ids=['default', 'every_option'])
def test_compiles_whole_in_eval_and_training(options):
    """aot_eager captures the forward and backward graphs as inductor gets them, without compiling kernels."""
    torch._dynamo.reset()
    model = small(depth=1, **dict(options, num_classes=2))
    randomize_queries(model)
    compiled_matches_eager(model, images(), 'aot_eager')


def test_compiles_whole_with_inductor():
    torch._dynamo.reset()
    model = small(depth=1, num_classes=2, **NARROW)
    randomize_queries(model)
    compiled_matches_eager(model, images(), 'inductor')


@pytest.mark.parametrize(
    'options', [{}, dict(memory_block_size=2), dict(value_norm='batchnorm', depth_kernel='gaussian')],
    ids=['default', 'block_memory', 'batchnorm_gaussian'])
def test_a_compiled_training_step_keeps_what_eager_keeps(options):
    """Under torch.compile, AOTAutograd's partitioner (here with inductor's decompositions, without compiling kernels)
    decides what the backward pass keeps. It recomputes the key and value paths' PReLU as eager does, instead of
    keeping two hidden-width outputs per block: within 10 % of eager's bytes (the reads' weights, which it keeps, are
    small at this depth). Keeping the PReLU outputs would cost 1.4x to 1.7x."""
    torch._dynamo.reset()
    model = small(num_classes=2, **options)
    x = images()
    eager = saved_activation_bytes(model, x)
    compiled = saved_activation_bytes(torch.compile(model, backend='aot_eager_decomp_partition', fullgraph=True), x)
    assert compiled <= 1.1 * eager
