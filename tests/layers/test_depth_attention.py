"""Learned-query attention over depth: the read of report Eq. 1-2, its memory buffers and its options."""
import math

import pytest
import torch

from timm_hbf.layers import DepthAttention, DepthKey, depth_attend, memory_slots, normalized_entropy, write_entry
from timm_hbf.layers.depth_attention import _attend


def memory(num_entries=5, batch=2, tokens=3, key_width=8, dim=12, capacity=7, dtype=torch.float64, seed=0):
    """Buffers with room for ``capacity`` entries and ``num_entries`` written, plus the written entries (the slots
    that :func:`write_entry` returns, from leaves that require grad)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.full((capacity, batch, tokens, key_width), float('nan'), dtype=dtype)
    values = torch.full((capacity, batch, tokens, dim), float('nan'), dtype=dtype)
    key_entries, value_entries = [], []
    for i in range(num_entries):
        k = torch.randn(batch, tokens, key_width, generator=g, dtype=dtype).requires_grad_()
        v = torch.randn(batch, tokens, dim, generator=g, dtype=dtype).requires_grad_()
        k, v = write_entry(keys, values, i, k, v)
        key_entries.append(k)
        value_entries.append(v)
    return keys, values, key_entries, value_entries


def explicit_read(query, key_entries, value_entries):
    """Eq. 1-2 written out per token and head, with loops: the specification the fast path must meet."""
    heads = query.shape[0]
    batch, tokens, dim = value_entries[0].shape
    out = torch.zeros(batch, tokens, dim, dtype=value_entries[0].dtype)
    dv = dim // heads
    for b in range(batch):
        for n in range(tokens):
            for h in range(heads):
                logits = torch.stack([k[b, n].view(heads, -1)[h] @ query[h] for k in key_entries])
                w = logits.softmax(0)
                out[b, n, h * dv:(h + 1) * dv] = sum(w[i] * v[b, n, h * dv:(h + 1) * dv]
                                                     for i, v in enumerate(value_entries))
    return out


def test_zero_query_reads_the_uniform_average_of_the_entries():
    keys, values, key_entries, value_entries = memory(dtype=torch.float32)
    read = DepthAttention(12, 8, num_heads=2, norm=False)
    out = read(keys, key_entries, value_entries)
    torch.testing.assert_close(out, torch.stack(value_entries).mean(0), rtol=0, atol=1e-6)


def test_zero_query_reads_the_layer_normed_average_with_the_default_norm():
    keys, values, key_entries, value_entries = memory(dtype=torch.float32)
    read = DepthAttention(12, 8, num_heads=2)
    mean = torch.stack(value_entries).mean(0)
    expected = torch.nn.functional.layer_norm(mean, (12,), eps=1e-6)
    torch.testing.assert_close(read(keys, key_entries, value_entries), expected, rtol=0, atol=1e-6)
    assert not any(p.shape == (12,) for p in read.parameters())  # LayerNorm without affine


@pytest.mark.parametrize('grad', [True, False])
def test_read_matches_the_equation_with_heads_splitting_keys_and_values(grad):
    keys, values, key_entries, value_entries = memory()
    query = torch.randn(2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.set_grad_enabled(grad):
        out = depth_attend(query, keys, key_entries, value_entries)
    torch.testing.assert_close(out, explicit_read(query, key_entries, value_entries))


def test_read_sees_only_the_entries_written_so_far():
    keys, values, key_entries, value_entries = memory(num_entries=3, capacity=7)  # the rest of the buffers is NaN
    query = torch.randn(2, 4, dtype=torch.float64)
    assert torch.isfinite(depth_attend(query, keys, key_entries, value_entries)).all()


def test_memory_slots_name_the_slot_of_each_written_entry():
    keys, _, key_entries, _ = memory(num_entries=5, capacity=7)
    assert memory_slots(keys, key_entries[::2]) == [0, 2, 4]
    assert memory_slots(keys, [key_entries[1].clone(), keys[3, :1]]) == [-1, -1]  # a copy; not a whole slot


@pytest.mark.parametrize('grad', [True, False])
def test_read_of_scattered_slots_matches_the_equation(grad):
    """Block-memory reads see summaries at scattered slots of the buffers, not a prefix."""
    keys, values, key_entries, value_entries = memory()
    key_entries, value_entries = key_entries[::2], value_entries[::2]
    query = torch.randn(2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.set_grad_enabled(grad):
        out = depth_attend(query, keys, key_entries, value_entries)
    torch.testing.assert_close(out, explicit_read(query, key_entries, value_entries))


@pytest.mark.parametrize('scattered', [False, True])
@pytest.mark.parametrize('norm_eps', [0., 1e-6])
@pytest.mark.parametrize('keep', [False, True])
def test_backward_matches_plain_autograd_on_stacked_entries(keep, norm_eps, scattered):
    keys, values, key_entries, value_entries = memory(num_entries=9 if scattered else 5, capacity=9)
    if scattered:
        key_entries, value_entries = key_entries[::2], value_entries[::2]
    query = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    mask = (torch.rand(5, 2, 3, 2, dtype=torch.float64) > .3) / .7 if keep else None
    grad_out = torch.randn(2, 3, 12, dtype=torch.float64)

    inputs = [query, *key_entries, *value_entries]
    out = depth_attend(query, keys, key_entries, value_entries, mask, norm_eps)
    fast = torch.autograd.grad(out, inputs, grad_out)
    plain_out = _attend(query, torch.stack(key_entries), value_entries, mask, norm_eps)
    torch.testing.assert_close(out, plain_out)
    plain = torch.autograd.grad(plain_out, inputs, grad_out)
    for f, p in zip(fast, plain):
        torch.testing.assert_close(f, p)


@pytest.mark.parametrize('norm_eps', [0., 1e-6])
def test_gradcheck(norm_eps):
    keys, values, key_entries, value_entries = memory(num_entries=3, batch=1, tokens=2, key_width=4, dim=4)
    query = torch.randn(2, 2, dtype=torch.float64, requires_grad=True)

    def read(q, *entries):  # writes, then reads: gradcheck perturbs the entries
        for i in range(3):
            write_entry(keys, values, i, entries[i], entries[3 + i])
        return depth_attend(q, keys, list(entries[:3]), list(entries[3:]), norm_eps=norm_eps)

    assert torch.autograd.gradcheck(read, (query, *key_entries, *value_entries))


def test_backward_survives_later_writes_to_the_buffers():
    keys, values, key_entries, value_entries = memory(num_entries=3, capacity=5)
    query = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    out = depth_attend(query, keys, key_entries, value_entries)
    expected = torch.autograd.grad(out.sum(), query, retain_graph=True)[0]
    write_entry(keys, values, 3, torch.randn(2, 3, 8), torch.randn(2, 3, 12))  # a later block writes
    torch.testing.assert_close(torch.autograd.grad(out.sum(), query)[0], expected)


def test_no_activation_memory_beyond_the_weights():
    """The read saves its weights (L, B, N, H), not the (L, B, N, D) products that plain autograd keeps."""
    keys, values, key_entries, value_entries = memory(num_entries=6, batch=4, tokens=16, key_width=8, dim=64)
    query = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        depth_attend(query, keys, key_entries, value_entries)
    assert sum(saved) == 6 * 4 * 16 * 2 + query.numel()


def test_broadcast_entries_get_summed_gradients():
    """The position-embedding entry is shared by the batch: it is written broadcast and its gradient is summed."""
    keys, values, key_entries, value_entries = memory(num_entries=2)
    shared = torch.randn(1, 3, 12, dtype=torch.float64, requires_grad=True)
    write_entry(keys, values, 2, torch.randn(2, 3, 8, dtype=torch.float64), shared)
    value_entries = value_entries + [shared.expand(2, -1, -1)]
    key_entries = key_entries + [keys[2].clone()]
    query = torch.randn(2, 4, dtype=torch.float64)
    out = depth_attend(query, keys, key_entries, value_entries)
    grad = torch.autograd.grad(out.sum(), shared)[0]
    plain = torch.autograd.grad(_attend(query, torch.stack(key_entries), value_entries, None, 0.).sum(),
                                shared)[0]
    torch.testing.assert_close(grad, plain)


def test_gaussian_kernel_reads_softmax_of_negative_squared_distances():
    key_dim, heads = 8, 2
    read = DepthAttention(12, key_dim, heads, kernel='gaussian', norm=False).double()
    fmt = DepthKey(key_dim, heads, kernel='gaussian')
    with torch.no_grad():
        read.query.normal_()
        read.kernel.log_gamma.copy_(torch.tensor([math.log(.3), math.log(.7)]))
    g = torch.Generator().manual_seed(0)
    raw_keys = [torch.randn(2, 3, key_dim, generator=g, dtype=torch.float64) for _ in range(4)]
    value_entries = [torch.randn(2, 3, 12, generator=g, dtype=torch.float64) for _ in range(4)]
    keys = torch.empty(4, 2, 3, fmt.width, dtype=torch.float64)
    values = torch.empty(4, 2, 3, 12, dtype=torch.float64)
    key_entries = [fmt(k) for k in raw_keys]
    for i in range(4):
        write_entry(keys, values, i, key_entries[i], value_entries[i])

    gamma = torch.tensor([.3, .7], dtype=torch.float64)
    k = torch.stack(raw_keys).unflatten(-1, (heads, -1))  # (L, B, N, H, dk)
    weights = (-gamma * (k - read.query).pow(2).sum(-1)).softmax(0)  # (L, B, N, H)
    v = torch.stack(value_entries).unflatten(-1, (heads, -1))
    expected = (weights.unsqueeze(-1) * v).sum(0).flatten(-2)
    torch.testing.assert_close(read(keys, key_entries, value_entries), expected)


def test_key_norm_gives_unit_keys_per_head():
    k = DepthKey(8, 2, normalize=True)(torch.randn(2, 3, 8) * 5)
    torch.testing.assert_close(k.unflatten(-1, (2, 4)).norm(dim=-1), torch.ones(2, 3, 2))


def test_gaussian_reads_with_unit_keys_start_uniform():
    """With unit keys, -gamma ||0 - k||^2 is the same for every entry: zero queries read the uniform average."""
    fmt = DepthKey(8, 2, normalize=True, kernel='gaussian')
    keys, values, _, value_entries = memory(dtype=torch.float32, key_width=fmt.width)
    key_entries = [fmt(torch.randn(2, 3, 8) * 3) for _ in value_entries]
    for i, (k, v) in enumerate(zip(key_entries, value_entries)):
        write_entry(keys, values, i, k, v)
    read = DepthAttention(12, 8, 2, kernel='gaussian', norm=False)
    out = read(keys, key_entries, value_entries)
    torch.testing.assert_close(out, torch.stack(value_entries).mean(0), rtol=0, atol=1e-6)


def test_path_dropout_drops_weights_in_training_only():
    keys, values, key_entries, value_entries = memory(dtype=torch.float32)
    read = DepthAttention(12, 8, 2, norm=False, path_drop=.5)
    torch.manual_seed(0)
    train_out = read(keys, key_entries, value_entries)
    mean = torch.stack(value_entries).mean(0)
    assert not torch.allclose(train_out, mean)
    read.eval()
    torch.testing.assert_close(read(keys, key_entries, value_entries), mean, rtol=0, atol=1e-6)


def test_normalized_entropy_is_one_for_uniform_and_zero_for_one_hot():
    assert normalized_entropy(torch.full((4, 2, 3), .25)).item() == pytest.approx(1.)
    one_hot = torch.zeros(4, 2, 3)
    one_hot[1] = 1.
    assert normalized_entropy(one_hot).item() == pytest.approx(0., abs=1e-6)


@pytest.mark.parametrize('kwargs, message', [
    (dict(dim=12, key_dim=8, num_heads=3), 'must both be divisible by the 3 depth-attention heads'),
    (dict(dim=12, key_dim=8, num_heads=2, kernel='cosine'), "Unknown depth-attention kernel 'cosine'"),
])
def test_bad_arguments_name_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DepthAttention(**kwargs)
