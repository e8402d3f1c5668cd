"""Learned-query attention over depth: the read of report Eq. 1-2 over a memory of entries, and its options."""
import gc
import math
import weakref

import pytest
import torch

from timm_hbf.layers import DepthAttention, DepthKey, depth_attend, depth_weights, normalized_entropy
from timm_hbf.layers.depth_attention import _read


def memory(num_entries=5, batch=2, tokens=3, key_width=8, dim=12, dtype=torch.float64, shared=False, seed=0):
    """Key and value entries, leaves that require grad. ``shared``: the second entry is shared by the batch, as the
    position embedding is (``(1, N, .)``), and the first by every token too, as the null entry is (``(width,)``)."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(batch, tokens)] * num_entries
    if shared:
        shapes[:2] = [(), (1, tokens)]
    key_entries = [torch.randn(*s, key_width, generator=g, dtype=dtype).requires_grad_() for s in shapes]
    value_entries = [torch.randn(*s, dim, generator=g, dtype=dtype).requires_grad_() for s in shapes]
    return key_entries, value_entries


def explicit_read(query, key_entries, value_entries, batch=2, tokens=3):
    """Eq. 1-2 written out per token and head, with loops: the specification the read must meet."""
    heads = query.shape[0]
    dim = value_entries[-1].shape[-1]
    keys = [k.expand(batch, tokens, -1) for k in key_entries]
    values = [v.expand(batch, tokens, -1) for v in value_entries]
    out = torch.zeros(batch, tokens, dim, dtype=values[0].dtype)
    dv = dim // heads
    for b in range(batch):
        for n in range(tokens):
            for h in range(heads):
                logits = torch.stack([k[b, n].view(heads, -1)[h] @ query[h] for k in keys])
                w = logits.softmax(0)
                out[b, n, h * dv:(h + 1) * dv] = sum(w[i] * v[b, n, h * dv:(h + 1) * dv] for i, v in enumerate(values))
    return out


def random_query(heads=2, width=4, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(heads, width, dtype=dtype, generator=g).requires_grad_()


# --- the read -------------------------------------------------------------------------------------------------------

def test_zero_query_reads_the_uniform_average_of_the_entries():
    key_entries, value_entries = memory(dtype=torch.float32)
    read = DepthAttention(12, 8, num_heads=2, norm=False)
    out = read(key_entries, value_entries)
    torch.testing.assert_close(out, torch.stack(value_entries).mean(0), rtol=0, atol=1e-6)


def test_zero_query_reads_the_layer_normed_average_with_the_default_norm():
    key_entries, value_entries = memory(dtype=torch.float32)
    read = DepthAttention(12, 8, num_heads=2)
    expected = torch.nn.functional.layer_norm(torch.stack(value_entries).mean(0), (12,), eps=1e-6)
    torch.testing.assert_close(read(key_entries, value_entries), expected, rtol=0, atol=1e-6)
    assert not any(p.shape == (12,) for p in read.parameters())  # LayerNorm without affine


@pytest.mark.parametrize('shared', [False, True])
@pytest.mark.parametrize('grad', [True, False])
def test_read_matches_the_equation_with_heads_splitting_keys_and_values(grad, shared):
    key_entries, value_entries = memory(shared=shared)
    query = random_query()
    with torch.set_grad_enabled(grad):
        out = depth_attend(query, key_entries, value_entries)
    torch.testing.assert_close(out, explicit_read(query, key_entries, value_entries))


def test_weights_are_the_softmax_over_entries_in_float32():
    key_entries, _ = memory(dtype=torch.bfloat16, shared=True)
    query = random_query(dtype=torch.float32)
    weights = depth_weights(query, key_entries)
    assert weights.shape == (5, 2, 3, 2) and weights.dtype == torch.float32
    torch.testing.assert_close(weights.sum(0), torch.ones(2, 3, 2))


# --- the backward pass ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize('shared', [False, True])
@pytest.mark.parametrize('norm_eps', [0., 1e-6])
@pytest.mark.parametrize('drop', [0., .4])
def test_backward_matches_plain_autograd(drop, norm_eps, shared):
    key_entries, value_entries = memory(shared=shared)
    query = random_query()
    grad_out = torch.randn(2, 3, 12, dtype=torch.float64)
    inputs = [query, *key_entries, *value_entries]
    torch.manual_seed(0)  # the same dropout mask in both
    out = depth_attend(query, key_entries, value_entries, drop, norm_eps)
    torch.manual_seed(0)
    plain_out = _read(query, key_entries, value_entries, drop, norm_eps)
    torch.testing.assert_close(out, plain_out)
    assert out.grad_fn.name() == '_DepthReadBackward'
    plain_grads = torch.autograd.grad(plain_out, inputs, grad_out)
    for ours, plain in zip(torch.autograd.grad(out, inputs, grad_out), plain_grads):
        torch.testing.assert_close(ours, plain)


@pytest.mark.parametrize('norm_eps, drop', [(0., 0.), (1e-6, 0.), (1e-6, .4)])
def test_gradcheck(norm_eps, drop):
    key_entries, value_entries = memory(num_entries=3, batch=1, tokens=2, key_width=4, dim=4, shared=True)

    def read(q, *entries):
        torch.manual_seed(0)  # the same dropout mask in every evaluation
        return depth_attend(q, list(entries[:3]), list(entries[3:]), drop, norm_eps)

    assert torch.autograd.gradcheck(read, (random_query(width=2), *key_entries, *value_entries))


def test_keeps_no_weights_for_the_backward_pass():
    """A read saves the query, the entries (which the memory holds anyway), its output and 1 / std: nothing of size
    (entries x tokens x heads), nor the mix before the norm."""
    key_entries, value_entries = memory(num_entries=6, batch=4, tokens=16, key_width=8, dim=64)
    query = random_query()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = depth_attend(query, key_entries, value_entries, norm_eps=1e-6)
    entries = {id(t) for t in key_entries + value_entries}
    others = [t for t in saved if id(t) not in entries and t is not query]
    assert len(saved) - len(others) == 13
    assert sorted(t.numel() for t in others) == [4 * 16, out.numel()]
    assert any(t.data_ptr() == out.data_ptr() for t in others)  # the output itself, not a copy


def test_keeps_nothing_outside_saved_tensor_hooks():
    """With hooks that keep copies, the entries themselves are freed after the forward pass: the read holds no
    reference of its own (e.g. on ctx), so activation offloading sees everything. The backward pass still works."""
    leaves = memory()
    inputs = [random_query(), *leaves[0], *leaves[1]]

    def read():
        key_entries = [k * 1. for k in leaves[0]]  # non-leaves, as a block's outputs are
        value_entries = [v * 1. for v in leaves[1]]
        return depth_attend(inputs[0], key_entries, value_entries, norm_eps=1e-6), key_entries + value_entries

    out, _ = read()
    expected = torch.autograd.grad(out.sum(), inputs)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        out, entries = read()
    refs = [weakref.ref(t) for t in entries]
    del entries
    gc.collect()
    assert all(r() is None for r in refs)
    for got, want in zip(torch.autograd.grad(out.sum(), inputs), expected):
        torch.testing.assert_close(got, want)


def test_save_on_cpu_gives_the_same_gradients():
    key_entries, value_entries = memory(shared=True)
    query = random_query()
    inputs = [query, *key_entries, *value_entries]
    expected = torch.autograd.grad(depth_attend(query, key_entries, value_entries, norm_eps=1e-6).sum(), inputs)
    with torch.autograd.graph.save_on_cpu():
        out = depth_attend(query, key_entries, value_entries, norm_eps=1e-6)
    for got, want in zip(torch.autograd.grad(out.sum(), inputs), expected):
        torch.testing.assert_close(got, want)


# --- dtypes ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('grad', [True, False])
def test_bf16_entries_are_summed_in_float32_under_autocast(grad):
    """The weights and the sum of values are float32 whatever the entries' dtype: a read of 9 bf16 entries equals
    the float32 read of the same numbers (a bf16 sum would be off by about 1e-2)."""
    key_entries, value_entries = memory(num_entries=9, dtype=torch.bfloat16)
    value_entries = [v.detach() * 50 + 300 for v in value_entries]  # large values: bf16 keeps ~2 digits of them
    query = torch.zeros(2, 4, requires_grad=True)  # uniform weights, exact in any dtype
    with torch.set_grad_enabled(grad), torch.autocast('cpu', dtype=torch.bfloat16):
        out = depth_attend(query, key_entries, value_entries)
    assert out.dtype == torch.float32
    expected = torch.stack([v.float() for v in value_entries]).mean(0)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=0)


def test_reads_in_float64_stay_in_float64():
    key_entries, value_entries = memory()
    query = random_query()
    assert depth_attend(query, key_entries, value_entries).dtype == torch.float64
    assert depth_weights(query, key_entries).dtype == torch.float64


def test_a_bf16_query_gives_a_bf16_result_of_a_float32_sum():
    key_entries, value_entries = memory(dtype=torch.bfloat16)
    query = random_query(dtype=torch.bfloat16)
    with torch.no_grad():
        out = depth_attend(query, key_entries, value_entries)
        expected = depth_attend(query.float(), [k.float() for k in key_entries], [v.float() for v in value_entries])
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=.01, atol=.01)


# --- kernels and options --------------------------------------------------------------------------------------------

def gaussian_read_and_keys(heads=2, key_dim=8, normalize=False):
    read = DepthAttention(12, key_dim, heads, kernel='gaussian', norm=False).double()
    fmt = DepthKey(key_dim, heads, normalize=normalize, kernel='gaussian')
    with torch.no_grad():
        read.kernel.log_gamma.copy_(torch.tensor([math.log(.3), math.log(.7)]))
    g = torch.Generator().manual_seed(0)
    raw_keys = [torch.randn(2, 3, key_dim, generator=g, dtype=torch.float64) * 2 for _ in range(4)]
    value_entries = [torch.randn(2, 3, 12, generator=g, dtype=torch.float64) for _ in range(4)]
    return read, fmt, raw_keys, value_entries


def gaussian_expected(query, raw_keys, value_entries, gamma, heads=2, normalize=False):
    k = torch.stack(raw_keys).unflatten(-1, (heads, -1))  # (L, B, N, H, dk)
    if normalize:
        k = torch.nn.functional.normalize(k, dim=-1)
    weights = (-gamma * (k - query).pow(2).sum(-1)).softmax(0)  # (L, B, N, H)
    v = torch.stack(value_entries).unflatten(-1, (heads, -1))
    return (weights.unsqueeze(-1) * v).sum(0).flatten(-2)


def test_gaussian_kernel_reads_softmax_of_negative_squared_distances():
    read, fmt, raw_keys, value_entries = gaussian_read_and_keys()
    with torch.no_grad():
        read.query.normal_()
    expected = gaussian_expected(read.query, raw_keys, value_entries, torch.tensor([.3, .7], dtype=torch.float64))
    torch.testing.assert_close(read([fmt(k) for k in raw_keys], value_entries), expected)


def test_gaussian_kernel_with_zero_queries_favours_short_keys():
    """Zero queries give softmax_i(-gamma_h ||k_{i,h}||^2), not the uniform average (see DepthAttention)."""
    read, fmt, raw_keys, value_entries = gaussian_read_and_keys()
    gamma = torch.tensor([.3, .7], dtype=torch.float64)
    expected = gaussian_expected(torch.zeros(2, 4, dtype=torch.float64), raw_keys, value_entries, gamma)
    out = read([fmt(k) for k in raw_keys], value_entries)
    torch.testing.assert_close(out, expected)
    assert not torch.allclose(out, torch.stack(value_entries).mean(0), atol=1e-3)


def test_gaussian_kernel_with_unit_keys_and_zero_queries_reads_the_uniform_average():
    read, fmt, raw_keys, value_entries = gaussian_read_and_keys(normalize=True)
    out = read([fmt(k) for k in raw_keys], value_entries)
    torch.testing.assert_close(out, torch.stack(value_entries).mean(0), rtol=0, atol=1e-12)


def test_key_norm_gives_unit_keys_per_head():
    k = DepthKey(8, 2, normalize=True)(torch.randn(2, 3, 8) * 5)
    torch.testing.assert_close(k.unflatten(-1, (2, 4)).norm(dim=-1), torch.ones(2, 3, 2))


def test_path_dropout_drops_weights_in_training_only():
    key_entries, value_entries = memory(dtype=torch.float32)
    read = DepthAttention(12, 8, 2, norm=False, path_drop=.5)
    mean = torch.stack(value_entries).mean(0)
    torch.manual_seed(0)
    assert not torch.allclose(read(key_entries, value_entries), mean)
    read.eval()
    torch.testing.assert_close(read(key_entries, value_entries), mean, rtol=0, atol=1e-6)


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
