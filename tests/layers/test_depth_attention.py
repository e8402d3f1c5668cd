"""Attention over depth: the read of report Eq. 1-2 over a memory of entries, how entries are stored and written, and
the memory itself: plain tensors and lists that autograd (double backward included), the compiler and eager code
share, and that two writes can branch from."""
import copy

import pytest
import torch
import torch.nn.functional as F

from timm_hbf.layers import DepthAttention, depth_logits, depth_weights


def memory(num_entries=5, batch=2, tokens=3, key_width=8, dim=12, dtype=torch.float64, shared=False, seed=0):
    """Key and value entries. ``shared``: the second entry is shared by the batch, as the position embedding is
    (``(1, N, .)``), and the first by every token too, as the null entry is (``(width,)``)."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(batch, tokens)] * num_entries
    if shared:
        shapes[:2] = [(), (1, tokens)]
    keys = [torch.randn(*s, key_width, generator=g, dtype=dtype) for s in shapes]
    values = [torch.randn(*s, dim, generator=g, dtype=dtype) for s in shapes]
    return keys, values


def placed(read, position, block_size):
    """``read`` (its query and kernel) at ``position`` of a memory block of ``block_size``."""
    other = copy.deepcopy(read)
    other.position, other.commit = position, position == block_size - 1
    return other


def store_all(read, memory_, keys, values, shape=(2, 3)):
    """``memory_`` with the entries stored for tokens of ``shape``, those shared by batch or tokens as they are."""
    tokens = torch.empty(*shape, 1)
    for key, value in zip(keys, values):
        memory_ = read.store(memory_, read.key(value if key is None else key), value, tokens)
    return memory_


def read_entries(read, keys, values, merge_last=False):
    """The entries stored for ``read``'s query alone (``merge_last``: the last one a running summary), then read."""
    memory_ = read.start([read.memory_query()])
    shape = torch.broadcast_shapes(*(v.shape[:-1] for v in values))
    if merge_last:
        memory_ = store_all(read, memory_, keys[:-1], values[:-1], shape)
        memory_ = placed(read, 0, 2).write(memory_, keys[-1], values[-1].expand(*shape, -1))  # not stored
        read = placed(read, 1, 2)
    else:
        memory_ = store_all(read, memory_, keys, values, shape)
    out, rest = read(memory_)
    assert rest.queries.shape[-1] == 0 and rest.logits == []  # the read is taken from the memory
    return out


def explicit_read(query, keys, values, batch=2, tokens=3):
    """Eq. 1-2 written out per token and head, with loops: the specification the read must meet."""
    heads = query.shape[0]
    dim = values[-1].shape[-1]
    keys = [k.expand(batch, tokens, -1) for k in keys]
    values = [v.expand(batch, tokens, -1) for v in values]
    out = torch.zeros(batch, tokens, dim, dtype=values[0].dtype)
    dv = dim // heads
    for b in range(batch):
        for n in range(tokens):
            for h in range(heads):
                logits = torch.stack([k[b, n].view(heads, -1)[h] @ query[h] for k in keys])
                w = logits.softmax(0)
                out[b, n, h * dv:(h + 1) * dv] = sum(w[i] * v[b, n, h * dv:(h + 1) * dv] for i, v in enumerate(values))
    return out


def read_with_query(heads=2, key_dim=8, dtype=torch.float64, seed=1, **kwargs):
    read = DepthAttention(key_dim, heads, **kwargs).to(dtype)
    with torch.no_grad():
        read.query.copy_(torch.randn(read.query.shape, generator=torch.Generator().manual_seed(seed)))
    return read


# --- the read -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('merge_last', [False, True], ids=['stored', 'last-a-running-summary'])
@pytest.mark.parametrize('shared', [False, True])
@pytest.mark.parametrize('grad', [True, False])
def test_read_matches_the_equation_with_heads_splitting_keys_and_values(grad, shared, merge_last):
    """A running block summary is read as one more entry."""
    keys, values = memory(shared=shared)
    read = read_with_query()
    with torch.set_grad_enabled(grad):
        out = read_entries(read, keys, values, merge_last)
    torch.testing.assert_close(out, explicit_read(read.query.detach(), keys, values))


def equation_read(read, keys, values):
    """Eq. 1 in plain autograd: the weights from the keys, the values stacked."""
    weights = depth_weights(read.memory_query(), [read.key(k) for k in keys])[..., 0, :]  # (..., H, L)
    stacked = torch.stack(torch.broadcast_tensors(*values), -2).unflatten(-1, (read.num_heads, -1))
    return torch.einsum('...hl,...lhd->...hd', weights, stacked).flatten(-2)


def chained_reads(reads, keys, values, merge=False):
    """Each read over the entries stored before it, each entry but the first depending on the read before it, as
    in a model (with ``merge``, the last read's entry starts a running summary that it reads, not stored)."""
    state = reads[0].start([read.memory_query() for read in reads])
    state = store_all(reads[0], state, keys[:1], values[:1])
    outputs = []
    for i, read in enumerate(reads):
        value = (values[i + 1] + .5 * outputs[-1] if outputs else values[i + 1]).expand(2, 3, -1)
        if merge and i == len(reads) - 1:
            state = placed(read, 0, 2).write(state, keys[i + 1], value)
            read = placed(read, 1, 2)
        else:
            state = read.store(state, read.key(keys[i + 1]), value, value)
        out, state = read(state)
        outputs.append(out)
    return outputs


def equation_chain(reads, keys, values):
    outputs, written = [], [values[0]]
    for i, read in enumerate(reads):
        written.append(values[i + 1] + .5 * outputs[-1] if outputs else values[i + 1])
        outputs.append(equation_read(read, keys[:i + 2], written).expand(2, 3, -1))
    return outputs


@pytest.mark.parametrize('merge', [False, True])
@pytest.mark.parametrize('num_reads', [3, 9])
def test_gradients_are_those_of_the_equation(merge, num_reads):
    """Of entries, keys and queries: those of Eq. 1 computed directly, in one backward pass and a second one."""
    reads = [read_with_query(seed=seed) for seed in range(1, num_reads + 1)]
    keys, values = memory(num_entries=num_reads + 1, shared=True)
    leaves = [t.requires_grad_() for t in keys + values] + [read.query for read in reads]
    outputs, expected = chained_reads(reads, keys, values, merge), equation_chain(reads, keys, values)
    torch.testing.assert_close(outputs, expected)
    weights = [torch.randn(2, 3, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
               for i in range(num_reads)]
    for _ in range(2):
        grads = [torch.autograd.grad(sum((out * w).sum() for out, w in zip(outs, weights)), leaves,
                                     retain_graph=True) for outs in (outputs, expected)]
        for got, want in zip(*grads):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize('kernel, key_norm', [('dot', ''), ('dot', 'rms'), ('gaussian', 'l2')])
def test_double_backward_passes_gradgradcheck(kernel, key_norm):
    """Gradient penalties and Hessian-vector products: plain autograd all the way."""
    reads = [read_with_query(seed=seed, kernel=kernel, key_norm=key_norm) for seed in (1, 2)]
    keys, values = memory(num_entries=3, shared=True)
    inputs = [t.requires_grad_() for t in keys + values]
    assert torch.autograd.gradgradcheck(lambda *t: chained_reads(reads, t[:3], t[3:])[-1], inputs)


def test_two_writes_from_one_memory_are_independent():
    """A memory is a value: a write returns a new one, so that two branches from one memory read their own entries."""
    read = read_with_query()
    keys, values = memory(num_entries=3)
    base = store_all(read, read.start([read.memory_query()]), keys[:1], values[:1])
    branch_a = store_all(read, base, keys[1:2], values[1:2])
    branch_b = store_all(read, base, keys[2:3], values[2:3])
    out_b, _ = read(branch_b)
    out_a, _ = read(branch_a)
    out_base, _ = read(base)
    query = read.query.detach()
    torch.testing.assert_close(out_a, explicit_read(query, keys[:2], values[:2]))
    torch.testing.assert_close(out_b, explicit_read(query, keys[::2], values[::2]))
    torch.testing.assert_close(out_base, values[0])


@pytest.mark.parametrize('compiled', [0, 1], ids=['compiled-then-eager', 'eager-then-compiled'])
def test_a_memory_passes_between_eager_and_compiled_code_unchanged(compiled):
    """As regional compilation and graph breaks hand it over: written in one, read in the other, the eager results."""
    reads = [read_with_query(seed=seed) for seed in (1, 2)]
    keys, values = memory(num_entries=3)
    leaves = [t.requires_grad_() for t in values] + [r.query for r in reads]

    def step(read, state, key, value):
        return read(read.store(state, read.key(key), value))

    def run(steps):
        state = store_all(reads[0], reads[0].start([r.memory_query() for r in reads]), keys[:1], values[:1])
        out, state = steps[0](reads[0], state, keys[1], values[1])
        return steps[1](reads[1], state, keys[2], values[2] + out)[0]

    torch._dynamo.reset()
    steps = [step, step]
    steps[compiled] = torch.compile(step, backend='aot_eager', fullgraph=True)
    got, expected = run(steps), run([step, step])
    torch.testing.assert_close(got, expected)
    for a, b in zip(*(torch.autograd.grad(out.sum(), leaves) for out in (got, expected))):
        torch.testing.assert_close(a, b)


def test_zero_queries_read_the_uniform_average_and_path_dropout_drops_weights_in_training_only():
    keys, values = memory(dtype=torch.float32)
    read = DepthAttention(8, 2, path_drop=.5)
    mean = torch.stack(values).mean(0)
    torch.manual_seed(0)
    assert not torch.allclose(read_entries(read, keys, values), mean)
    read.eval()
    torch.testing.assert_close(read_entries(read, keys, values), mean, rtol=0, atol=1e-6)


# --- dtypes ---------------------------------------------------------------------------------------------------------

def test_bf16_entries_are_read_with_float32_weights_and_sums():
    """Under autocast the read of 9 bf16 entries is the float32 read of the same numbers; a bf16 query gives that
    read rounded once to bf16 (bf16 weights or sums would be off by about 1e-2)."""
    keys, values = memory(num_entries=9, dtype=torch.bfloat16)
    values = [v * 50 + 300 for v in values]  # large values: bf16 keeps ~2 digits of them
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out = read_entries(DepthAttention(8, 2), keys, values)  # zero queries: uniform weights, exact in any dtype
    torch.testing.assert_close(out, torch.stack([v.float() for v in values]).mean(0), rtol=1e-6, atol=0)
    read = read_with_query(dtype=torch.bfloat16)
    expected = read_entries(read.float(), [k.float() for k in keys], [v.float() for v in values])
    torch.testing.assert_close(read_entries(read.bfloat16(), keys, values), expected.bfloat16(), rtol=0, atol=0)


# --- stored keys and kernels ----------------------------------------------------------------------------------------

def test_l2_keys_are_unit_per_head_and_rms_keys_are_stored_as_they_are_and_normalised_in_the_logits():
    k = torch.randn(2, 3, 8) * 5
    unit = DepthAttention(8, 2, key_norm='l2').key(k).unflatten(-1, (2, 4))
    torch.testing.assert_close(unit.norm(dim=-1), torch.ones(2, 3, 2))
    read = read_with_query(key_norm='rms', dtype=torch.float32)
    assert read.key(k) is k
    rms = F.rms_norm(k.unflatten(-1, (2, 4)), [4], eps=1e-6).flatten(-2)
    query = read.memory_query()
    torch.testing.assert_close(depth_logits(k, query, rms=True), depth_logits(rms, query))
    torch.testing.assert_close(F.normalize(rms.unflatten(-1, (2, 4)), dim=-1), unit)


@pytest.mark.parametrize('heads, shape', [(1, (2, 3)), (3, (2, 3)), (1, (1, 3)), (2, ())],
                         ids=['one-head', 'heads', 'shared-by-the-batch', 'shared-by-every-token'])
def test_logits_of_rms_keys_have_the_gradients_of_normalised_keys(heads, shape):
    """The logits of RMS-normalised keys, formed without a normalised copy, have the gradients (numerical, and those
    of ``rms_norm``'s keys) that the keys and the queries would have through the normalised copy."""
    g = torch.Generator().manual_seed(0)
    k = torch.randn(*shape, heads * 4, dtype=torch.float64, generator=g).requires_grad_()
    queries = torch.randn(heads, 4, 5, dtype=torch.float64, generator=g).requires_grad_()
    assert torch.autograd.gradcheck(lambda k, q: depth_logits(k, q, rms=True), (k, queries))
    weights = torch.randn(*shape, heads, 5, dtype=torch.float64, generator=g)
    normalised = F.rms_norm(k.unflatten(-1, (heads, 4)), [4], eps=1e-6).flatten(-2)
    got = torch.autograd.grad((depth_logits(k, queries, rms=True) * weights).sum(), (k, queries))
    torch.testing.assert_close(got, torch.autograd.grad((depth_logits(normalised, queries) * weights).sum(),
                                                        (k, queries)))


@pytest.mark.parametrize('key_norm, zero_query', [('', False), ('', True), ('l2', True)],
                         ids=['queries', 'zero-queries', 'zero-queries-unit-keys'])
def test_gaussian_kernel_reads_softmax_of_negative_squared_distances(key_norm, zero_query):
    """Zero queries give softmax_i(-gamma_h ||k_{i,h}||^2), which favours short keys: the uniform average for unit
    keys alone."""
    read = read_with_query(kernel='gaussian', key_norm=key_norm)
    gamma = torch.tensor([.3, .7], dtype=torch.float64)
    with torch.no_grad():
        read.kernel.log_gamma.copy_(gamma.log())
        read.query.mul_(0. if zero_query else 1.)
    keys, values = memory(num_entries=4)
    k = torch.stack(keys).unflatten(-1, (2, -1)) * 2  # (L, B, N, H, dk)
    k = F.normalize(k, dim=-1) if key_norm else k
    weights = (-gamma * (k - read.query).pow(2).sum(-1)).softmax(0)  # (L, B, N, H)
    out = read_entries(read, [key * 2 for key in keys], values)
    torch.testing.assert_close(out, (weights.unsqueeze(-1) * torch.stack(values).unflatten(-1, (2, -1))).sum(0)
                               .flatten(-2))
    off_uniform = (out - torch.stack(values).mean(0)).abs().max()
    assert off_uniform < 1e-12 if zero_query and key_norm else off_uniform > 1e-3


# --- writing: entries and block summaries ---------------------------------------------------------------------------

def summary_memory(read, keys, values):
    """The first entry alone, then a block of the other two: the second starts it, the third is merged into it."""
    memory_ = store_all(read, read.start([read.memory_query()]), keys[:1], values[:1], values[0].shape[:-1])
    memory_ = placed(read, 0, 3).write(memory_, keys[1], values[1])
    return placed(read, 1, 3).write(memory_, keys[2], values[2])


@pytest.mark.parametrize('kernel', ['dot', 'gaussian'])
def test_a_summary_sums_its_values_and_its_logit_is_its_members_mean_logit(kernel):
    read = read_with_query(kernel=kernel)
    (k0, k1, k2), (v0, v1, v2) = memory(num_entries=3)
    merged = summary_memory(read, [k0, k1, k2], [v0, v1, v2])
    torch.testing.assert_close(merged.value, v1 + v2)
    query = read.memory_query()
    logits = depth_weights(query, [read.key(k0), merged.key]).log()
    members = depth_weights(query, [read.key(k0), read.key(k1)]).log(), depth_weights(query, [read.key(k0),
                                                                                           read.key(k2)]).log()
    # softmax logits up to a constant per token and head: compare differences to the first entry
    expected = (members[0][..., 1] - members[0][..., 0] + members[1][..., 1] - members[1][..., 0]) / 2
    torch.testing.assert_close(logits[..., 1] - logits[..., 0], expected)


def test_keys_from_values_are_the_normalised_values_and_a_summary_s_key_that_of_its_sum():
    """AttnRes: k_i = RMSNorm(v_i); in Block AttnRes the key of a block is that of the block's sum."""
    read = read_with_query(heads=3, key_dim=12, key_norm='rms')
    _, (v0, v1, v2) = memory(num_entries=3)
    merged = summary_memory(read, [None] * 3, [v0, v1, v2])
    rms = [F.rms_norm(v.unflatten(-1, (3, 4)), [4], eps=1e-6).flatten(-2) for v in (v0, v1 + v2)]
    query = read.memory_query()
    torch.testing.assert_close(depth_weights(query, [read.key(v0), merged.key], rms=read.rms_logits),
                               depth_weights(query, rms))
    torch.testing.assert_close(placed(read, 2, 3)(merged)[0], explicit_read(read.query.detach(), rms, [v0, v1 + v2]))


def test_summaries_add_up_in_float32_under_autocast():
    """A summary of bf16 entries is their float32 sum, its key the float32 mean of their keys, exactly."""
    read = DepthAttention(8, 2)
    keys, values = memory(num_entries=3, dtype=torch.bfloat16)
    values[1] = values[1] * 50 + 300  # a bf16 sum would round away most of the smaller value
    with torch.autocast('cpu', dtype=torch.bfloat16):
        merged = summary_memory(read, keys, values)
    assert merged.key.dtype == merged.value.dtype == torch.float32 and merged.values[0].dtype == torch.bfloat16
    torch.testing.assert_close(merged.value, values[1].float() + values[2].float(), rtol=0, atol=0)
    torch.testing.assert_close(merged.key, (keys[1].float() + keys[2].float()) / 2, rtol=1e-6, atol=0)


@pytest.mark.parametrize('kwargs, error, message', [
    (dict(key_dim=0), ValueError, r'key_dim must be an integer >= 1, got 0'),
    (dict(num_heads=3), ValueError, r'num_heads must be a divisor of key_dim \(8\), got 3'),
    (dict(kernel='gausian'), ValueError, r"kernel must be one of \('dot', 'gaussian'\), got 'gausian'"),
    (dict(key_norm='L2'), ValueError, r"key_norm must be one of \('', 'l2', 'rms'\), got 'L2'"),
    (dict(path_drop=1.), ValueError, r'path_drop must be a rate in \[0, 1\), got 1.0'),
    (dict(block_size=0), ValueError, r'block_size must be an integer >= 1, got 0'),
], ids=['no_key_width', 'heads_not_dividing_the_key', 'unknown_kernel', 'unknown_key_norm', 'path_drop_of_one',
        'empty_memory_block'])
def test_a_bad_argument_is_rejected_with_its_name_its_value_and_what_is_allowed(kwargs, error, message):
    with pytest.raises(error, match=message):
        DepthAttention(**dict(dict(key_dim=8, num_heads=2), **kwargs))
