"""Attention over depth: the read of report Eq. 1-2 over a memory of entries, how entries are stored and written,
and the memory's stacks, whose reads cost as many operations whatever the number of entries and keep no copy of them
for the backward pass."""
import collections
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from timm_hbf.layers import DepthAttention, depth_logits, depth_weights, normalized_entropy
from timm_hbf.layers.depth_attention import append_entry, depth_read


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


def read_entries(read, keys, values, keep=None, merge_last=False):
    """Write the entries into a memory for ``read``'s query alone (the last merged into a running summary, not
    committed, with ``merge_last``), then read it."""
    queries = read.memory_query()
    memory = read.start(queries, keep, values[-1] if values[-1].dim() == 3 else values[0])
    for i, (key, value) in enumerate(zip(keys, values)):
        last = merge_last and i == len(keys) - 1
        memory = read.write(memory, key, value, commit=not last)
    out, rest = read(memory, merge=merge_last)
    assert rest.queries.shape[-1] == 0  # the read is taken from the memory
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

def test_zero_query_reads_the_uniform_average_of_the_entries():
    keys, values = memory(dtype=torch.float32)
    out = read_entries(DepthAttention(8, num_heads=2), keys, values)
    torch.testing.assert_close(out, torch.stack(values).mean(0), rtol=0, atol=1e-6)


@pytest.mark.parametrize('shared', [False, True])
@pytest.mark.parametrize('grad', [True, False])
def test_read_matches_the_equation_with_heads_splitting_keys_and_values(grad, shared):
    keys, values = memory(shared=shared)
    read = read_with_query()
    with torch.set_grad_enabled(grad):
        out = read_entries(read, keys, values)
    torch.testing.assert_close(out, explicit_read(read.query.detach(), keys, values))


@pytest.mark.parametrize('values_shape, logits_shape', [((4, 2, 3, 12), (4, 2, 3, 2)), ((4, 1, 3, 12), (4, 2, 3, 2)),
                                                        ((4, 2, 3, 12), (4, 1, 3, 2))],
                         ids=['same', 'values-shared', 'logits-shared'])
def test_a_read_of_stacked_values_has_the_gradients_of_the_softmax_and_the_sum(values_shape, logits_shape):
    """``depth_read`` on stacks of its own, shared over the batch or not: the gradients of Eq. 1 in plain autograd."""
    g = torch.Generator().manual_seed(0)
    logits, values = (torch.randn(*s, dtype=torch.float64, generator=g).requires_grad_()
                      for s in (logits_shape, values_shape))
    grad = torch.randn(2, 3, 12, dtype=torch.float64, generator=g)
    expected = (logits.softmax(0).unsqueeze(-1) * values.unflatten(-1, (2, -1))).sum(0).flatten(-2)
    got = depth_read(logits, values, [], num_heads=2)
    torch.testing.assert_close(got, expected)
    for a, b in zip(*(torch.autograd.grad(out, (logits, values), grad) for out in (got, expected))):
        torch.testing.assert_close(a, b)


def test_an_empty_batch_reads_nothing():
    keys, values = memory(batch=0, shared=True)
    assert read_entries(read_with_query(), keys, values).shape == (0, 3, 12)


def test_weights_are_the_softmax_over_entries_in_float32_entries_last():
    keys, _ = memory(dtype=torch.bfloat16, shared=True)
    weights = depth_weights(read_with_query(dtype=torch.float32).memory_query(), keys)
    assert weights.shape == (2, 3, 2, 1, 5) and weights.dtype == torch.float32
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 3, 2, 1))


@pytest.mark.parametrize('shared', [False, True])
def test_a_read_merges_the_running_summary_as_one_more_entry(shared):
    keys, values = memory(shared=shared)
    read = read_with_query()
    torch.testing.assert_close(read_entries(read, keys, values, merge_last=True),
                               explicit_read(read.query.detach(), keys, values))


def test_the_memory_keeps_sums_for_every_read_to_come_and_each_read_takes_its_own():
    """Three reads with their own queries, over the entries written before each."""
    reads = [read_with_query(seed=seed) for seed in (1, 2, 3)]
    keys, values = memory(num_entries=4)
    memory_ = reads[0].start(torch.cat([r.memory_query() for r in reads], -1), None, values[0])
    for i, read in enumerate(reads):
        memory_ = read.write(memory_, keys[i], values[i])
        out, memory_ = read(memory_)
        torch.testing.assert_close(out, explicit_read(read.query.detach(), keys[:i + 1], values[:i + 1]))


def equation_read(read, keys, values):
    """Eq. 1 in plain autograd: the weights from the keys, the values stacked."""
    weights = depth_weights(read.memory_query(), [read.key(k) for k in keys])[..., 0, :]  # (..., H, L)
    stacked = torch.stack(torch.broadcast_tensors(*values), -2).unflatten(-1, (read.num_heads, -1))
    return torch.einsum('...hl,...lhd->...hd', weights, stacked).flatten(-2)


@pytest.mark.parametrize('capacity', [0, 4], ids=['growing', 'preallocated'])
@pytest.mark.parametrize('merge', [False, True])
@pytest.mark.parametrize('num_reads', [3, 9])
def test_gradients_are_those_of_the_equation(merge, capacity, num_reads):
    """Reads each over the entries written before it (the last one merging the newest as a running summary): the
    gradients of entries, keys and queries are those of Eq. 1 computed directly, though the backward pass sums every
    read's gradient of the values into one buffer, the stacks share one storage, and the reads' gradients of the
    logits share buffers with room for the reads before them."""
    reads = [read_with_query(seed=seed) for seed in range(1, num_reads + 1)]
    keys, values = memory(num_entries=num_reads + 1, shared=True)
    leaves = [t.requires_grad_() for t in keys + values]
    weights = [torch.randn(2, 3, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
               for i in range(num_reads)]

    def gradients(outputs):
        for read in reads:
            read.zero_grad()
        grads = torch.autograd.grad(sum((out * w).sum() for out, w in zip(outputs, weights)), leaves,
                                    retain_graph=True)
        return grads + tuple(torch.autograd.grad(sum((out * w).sum() for out, w in zip(outputs, weights)),
                                                 [read.query for read in reads]))

    state = reads[0].start(torch.cat([read.memory_query() for read in reads], -1), None, values[-1], capacity)
    state = reads[0].write(state, keys[0], values[0])
    outputs = []
    for i, read in enumerate(reads):
        last = merge and i == num_reads - 1
        state = read.write(state, keys[i + 1], values[i + 1], commit=not last)
        out, state = read(state, merge=last)
        outputs.append(out)
    expected = [equation_read(read, keys[:i + 2], values[:i + 2]).expand(2, 3, 12) for i, read in enumerate(reads)]
    torch.testing.assert_close(outputs, expected)
    for got, want in zip(gradients(outputs), gradients(expected)):
        torch.testing.assert_close(got, want)


def test_backward_passes_over_one_graph_give_the_gradients_of_the_equation_each_time():
    """Each entry depends on the read before it, as in a model, so that a read's gradient is added in place into
    the one its stack's next write passes on: a second pass over the same graph (``retain_graph``), and one that
    stops at the first read, give the gradients of the equation too."""
    reads = [read_with_query(seed=seed) for seed in (1, 2, 3)]
    keys, values = memory(num_entries=4)
    leaves = [t.requires_grad_() for t in keys + values]

    def chain(read_fn):
        outputs, written = [], [values[0]]
        for i, read in enumerate(reads):
            written.append(values[i + 1] + .5 * (outputs[-1] if outputs else 0))
            outputs.append(read_fn(i, read, written))
        return outputs

    state = [reads[0].start(torch.cat([read.memory_query() for read in reads], -1), None, values[0], 4)]
    state[0] = reads[0].write(state[0], keys[0], values[0])

    def memory_read(i, read, written):
        state[0] = read.write(state[0], keys[i + 1], written[-1])
        out, state[0] = read(state[0])
        return out

    outputs = chain(memory_read)
    expected = chain(lambda i, read, written: equation_read(read, keys[:i + 2], written))
    for loss, reference in ((outputs[-1].sum(), expected[-1].sum()), (outputs[0].sum(), expected[0].sum()),
                            (outputs[-1].sum(), expected[-1].sum())):
        grads = [torch.autograd.grad(y, leaves, retain_graph=True, allow_unused=True, materialize_grads=True)
                 for y in (loss, reference)]
        for got, want in zip(*grads):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize('dim', [0, 1], ids=['values', 'logits'])
def test_an_appended_entry_is_the_next_index_of_the_stack_in_eager_and_scripted_code(dim):
    """Values take an entry as a row; the logits, reads outermost, take an entry ``(..., R)`` with its last dim
    first. Both broadcast the entry (an entry shared by the batch)."""
    stack = torch.randn(5, 3, 2, 4) if dim else torch.randn(3, 2, 4)
    entry = torch.randn(4, 5) if dim else torch.randn(4)
    expected = torch.cat([stack, (entry.t() if dim else entry).unsqueeze(-2).expand(stack.select(dim, 0).shape)
                         .unsqueeze(dim)], dim)
    for append in (append_entry, torch.jit.script(append_entry)):
        out, _ = append(stack.clone(), entry, False, dim)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_reads_keep_their_stacks_in_one_storage():
    """32 reads, each over the entries written before it: the backward pass keeps about the entries themselves (a
    copy of its stack for every read would be 16 times as much)."""
    read = read_with_query(dtype=torch.float32)
    keys, values = memory(num_entries=32, batch=4, tokens=16, dim=256, dtype=torch.float32)
    values = [v.requires_grad_() for v in values]
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        state = read.start(read.memory_query().expand(-1, -1, 32), None, values[0], 32)
        for key, value in zip(keys, values):
            state = read.write(state, key, value)
            _, state = read(state)
    assert sum(storages.values()) < 1.5 * sum(v.numel() * v.element_size() for v in values)


def test_the_logits_keep_only_the_reads_still_to_come():
    """32 reads, each after a write: the logits grow by doubling and each growth drops the columns of the reads
    taken, so that they never take the room of every entry's logits for every read, and end under a half of it."""
    read = read_with_query(dtype=torch.float32)
    keys, values = memory(num_entries=32, dtype=torch.float32)
    state = read.start(read.memory_query().expand(-1, -1, 32), None, values[0], 32)
    every_read = 32 * 32 * state.logits.shape[2:].numel() * state.logits.element_size()
    sizes = []
    for key, value in zip(keys, values):
        state = read.write(state, key, value)
        sizes.append(state.logits.untyped_storage().nbytes())
        _, state = read(state)
    assert max(sizes) < every_read and sizes[-1] < every_read / 2


class OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[func] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize('merge', [False, True])
def test_a_write_and_a_read_take_as_many_operations_whatever_the_number_of_entries(merge):
    """Forward and backward: a read is not a loop over the entries."""
    counts = []
    for num in (3, 12):
        read = read_with_query(dtype=torch.float32)
        keys, values = memory(num_entries=num, dtype=torch.float32)
        values = [v.requires_grad_() for v in values]
        queries = read.memory_query().expand(-1, -1, 4)  # this read and three later ones
        state = read.start(queries, None, values[0])
        for key, value in zip(keys[:-1], values[:-1]):
            state = read.write(state, key, value)
        # the stacks so far as leaves: the backward pass counted is this write's and this read's alone
        state = state._replace(**{name: getattr(state, name).detach().requires_grad_()
                                  for name in ('logits', 'values', 'key', 'value')})
        with OpCount() as ops:
            state = read.write(state, keys[-1], values[-1], commit=not merge)
            out, _ = read(state, merge=merge)
            out.sum().backward()
        counts.append(sum(ops.count.values()))
    assert counts[0] == counts[1]


def test_path_dropout_drops_weights_in_training_only():
    keys, values = memory(dtype=torch.float32)
    read = DepthAttention(8, 2, path_drop=.5)
    keep = torch.tensor([.5])
    mean = torch.stack(values).mean(0)
    torch.manual_seed(0)
    assert not torch.allclose(read_entries(read, keys, values, keep), mean)
    read.eval()
    torch.testing.assert_close(read_entries(read, keys, values, keep), mean, rtol=0, atol=1e-6)


# --- dtypes ---------------------------------------------------------------------------------------------------------

def test_bf16_entries_are_summed_in_float32_under_autocast():
    """The weights and the sum of values are float32 whatever the entries' dtype: a read of 9 bf16 entries equals
    the float32 read of the same numbers (a bf16 sum would be off by about 1e-2)."""
    keys, values = memory(num_entries=9, dtype=torch.bfloat16)
    values = [v * 50 + 300 for v in values]  # large values: bf16 keeps ~2 digits of them
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out = read_entries(DepthAttention(8, 2), keys, values)  # zero queries: uniform weights, exact in any dtype
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.stack([v.float() for v in values]).mean(0), rtol=1e-6, atol=0)


def test_reads_in_float64_stay_in_float64():
    keys, values = memory()
    read = read_with_query()
    assert read_entries(read, keys, values).dtype == depth_weights(read.memory_query(), keys).dtype == torch.float64


def test_a_bf16_query_gives_a_bf16_result_of_a_float32_sum():
    """The float32 read of the same numbers, rounded once to bf16 (bf16 weights or sums would be off by ~1e-2)."""
    keys, values = memory(dtype=torch.bfloat16)
    values = [v * 50 + 300 for v in values]
    read = read_with_query(dtype=torch.bfloat16)
    out = read_entries(read, keys, values)
    expected = read_entries(read.float(), [k.float() for k in keys], [v.float() for v in values])
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected.bfloat16(), rtol=0, atol=0)


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


def gaussian_read(key_norm=''):
    read = read_with_query(kernel='gaussian', key_norm=key_norm)
    with torch.no_grad():
        read.kernel.log_gamma.copy_(torch.tensor([math.log(.3), math.log(.7)]))
    keys, values = memory(num_entries=4)
    return read, [k * 2 for k in keys], values


def gaussian_expected(query, raw_keys, values, gamma, key_norm=''):
    k = torch.stack(raw_keys).unflatten(-1, (2, -1))  # (L, B, N, H, dk)
    if key_norm:
        k = F.normalize(k, dim=-1)
    weights = (-gamma * (k - query).pow(2).sum(-1)).softmax(0)  # (L, B, N, H)
    return (weights.unsqueeze(-1) * torch.stack(values).unflatten(-1, (2, -1))).sum(0).flatten(-2)


def test_gaussian_kernel_reads_softmax_of_negative_squared_distances():
    read, raw_keys, values = gaussian_read()
    expected = gaussian_expected(read.query, raw_keys, values, torch.tensor([.3, .7], dtype=torch.float64))
    torch.testing.assert_close(read_entries(read, raw_keys, values), expected)


def test_gaussian_kernel_with_zero_queries_favours_short_keys():
    """Zero queries give softmax_i(-gamma_h ||k_{i,h}||^2), not the uniform average (see DepthAttention)."""
    read, raw_keys, values = gaussian_read()
    with torch.no_grad():
        read.query.zero_()
    expected = gaussian_expected(read.query, raw_keys, values, torch.tensor([.3, .7], dtype=torch.float64))
    out = read_entries(read, raw_keys, values)
    torch.testing.assert_close(out, expected)
    assert not torch.allclose(out, torch.stack(values).mean(0), atol=1e-3)


def test_gaussian_kernel_with_unit_keys_and_zero_queries_reads_the_uniform_average():
    read, raw_keys, values = gaussian_read(key_norm='l2')
    with torch.no_grad():
        read.query.zero_()
    out = read_entries(read, raw_keys, values)
    torch.testing.assert_close(out, torch.stack(values).mean(0), rtol=0, atol=1e-12)


# --- writing: entries and block summaries ---------------------------------------------------------------------------

def summary_memory(read, keys, values):
    """The first entry alone, then a block of the other two: the second starts it, the third is merged into it."""
    memory = read.start(read.memory_query(), None, values[0])
    memory = read.write(memory, keys[0], values[0])
    memory = read.write(memory, keys[1], values[1], position=0, commit=False)
    return read.write(memory, keys[2], values[2], position=1, commit=False)


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
    torch.testing.assert_close(read(merged, merge=True)[0], explicit_read(read.query.detach(), rms, [v0, v1 + v2]))


def test_summaries_add_up_in_float32_under_autocast():
    """A summary of bf16 entries is their float32 sum, its key the float32 mean of their keys, exactly."""
    read = DepthAttention(8, 2)
    keys, values = memory(num_entries=3, dtype=torch.bfloat16)
    values[1] = values[1] * 50 + 300  # a bf16 sum would round away most of the smaller value
    with torch.autocast('cpu', dtype=torch.bfloat16):
        merged = summary_memory(read, keys, values)
    assert merged.key.dtype == merged.value.dtype == merged.values.dtype == torch.float32
    torch.testing.assert_close(merged.value, values[1].float() + values[2].float(), rtol=0, atol=0)
    torch.testing.assert_close(merged.key, (keys[1].float() + keys[2].float()) / 2, rtol=1e-6, atol=0)


def test_normalized_entropy_is_one_for_uniform_and_zero_for_one_hot():
    assert normalized_entropy(torch.full((2, 3, 4), .25)).item() == pytest.approx(1.)
    one_hot = torch.zeros(2, 3, 4)
    one_hot[..., 1] = 1.
    assert normalized_entropy(one_hot).item() == pytest.approx(0., abs=1e-6)


@pytest.mark.parametrize('kwargs, error, message', [
    (dict(key_dim=0), ValueError, r'key_dim must be an integer >= 1, got 0'),
    (dict(num_heads=3), ValueError, r'num_heads must be a divisor of key_dim \(8\), got 3'),
    (dict(kernel='gausian'), ValueError, r"kernel must be one of \('dot', 'gaussian'\), got 'gausian'"),
    (dict(key_norm='L2'), ValueError, r"key_norm must be one of \('', 'l2', 'rms'\), got 'L2'"),
    (dict(path_drop=1.), ValueError, r'path_drop must be a rate in \[0, 1\), got 1.0'),
], ids=['no_key_width', 'heads_not_dividing_the_key', 'unknown_kernel', 'unknown_key_norm', 'path_drop_of_one'])
def test_a_bad_argument_is_rejected_with_its_name_its_value_and_what_is_allowed(kwargs, error, message):
    with pytest.raises(error, match=message):
        DepthAttention(**dict(dict(key_dim=8, num_heads=2), **kwargs))
