"""HyperBFAttention: per head, softmax_j(-gamma_h ||W (q_i - k_j)||^2 + mask_ij) v_j (memo Eq. 6); a fused path on
F.scaled_dot_product_attention and a reference path with explicit distances."""
import pytest
import torch
import torch.nn.functional as F
from timm.layers import set_fused_attn
from timm.models.vision_transformer import Block

from timm_hbf.layers import HyperBFAttention
from timm_hbf.layers.hyperbf_attention import gaussian_sdpa

from ..helpers import ShapeRecorder, dropout_matches_its_expectation, layer_normed


def make_pair(dtype=torch.float32, **kwargs):
    """The same attention layer twice: fused path and reference path, widths away from init."""
    torch.manual_seed(0)
    fused = HyperBFAttention(48, num_heads=3, qkv_bias=True, dtype=dtype, **kwargs)
    reference = HyperBFAttention(48, num_heads=3, qkv_bias=True, dtype=dtype, **kwargs)
    with torch.no_grad():
        fused.kernel.log_gamma.copy_(torch.linspace(-3., -1., fused.kernel.log_gamma.numel()))
        if fused.kernel.metric is not None:
            fused.kernel.metric.add_(0.1 * torch.randn_like(fused.kernel.metric))
    reference.load_state_dict(fused.state_dict())
    reference.fused_attn = False
    assert fused.fused_attn == (kwargs.get('kernel') != 'laplacian')  # the Laplacian kernel: the reference path alone
    return fused, reference


def explicit_attention(attn, x, mask=None):
    """The formula, written out with cdist; ``mask`` additive, (B or 1, H or 1, N, N)."""
    B, N, C = x.shape
    q, k, v = attn.qkv(x).reshape(B, N, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4)
    q, k = attn.kernel.project(attn.q_norm(q)), attn.kernel.project(attn.k_norm(k))
    distance = torch.cdist(q, k).pow(2)
    distance = distance if attn.kernel.kernel == 'gaussian' else (distance + attn.kernel.eps).sqrt()
    logits = -attn.kernel.gamma().reshape(-1, 1, 1) * distance
    weights = torch.softmax(logits if mask is None else logits + mask, dim=-1)
    return attn.proj(attn.norm((weights @ v).transpose(1, 2).reshape(B, N, C)))


def masks(tokens):
    """Each kind of mask SDPA takes, and the same as an additive mask for :func:`explicit_attention`."""
    g = torch.Generator().manual_seed(1)
    boolean = torch.rand(2, 1, tokens, tokens, generator=g) > 0.3
    boolean[..., 0] = True  # every query attends to something
    additive = torch.randn(2, 3, tokens, tokens, generator=g, dtype=torch.float64)
    causal = torch.full((tokens, tokens), float('-inf'), dtype=torch.float64).triu(1)
    return {
        'none': (dict(), None),
        'boolean': (dict(attn_mask=boolean), torch.zeros(boolean.shape, dtype=torch.float64).masked_fill(
            ~boolean, float('-inf'))),
        'additive': (dict(attn_mask=additive), additive),
        'causal': (dict(is_causal=True), causal),
    }


def grads(module, x, out_grad, **kwargs):
    module.zero_grad()
    x = x.clone().requires_grad_()
    module(x, **kwargs).backward(out_grad)
    return [x.grad] + [p.grad for p in module.parameters()]


OPTIONS = pytest.mark.parametrize('options', [
    dict(), dict(gamma_per_head=False), dict(mahalanobis=True),
    dict(qk_norm=True, scale_norm=True, norm_layer=torch.nn.LayerNorm), dict(kernel='laplacian'),
], ids=['default', 'one_width', 'mahalanobis', 'qk_norm_scale_norm', 'laplacian'])


@OPTIONS
@pytest.mark.parametrize('mask', ['none', 'boolean', 'additive', 'causal'])
def test_both_paths_compute_the_formula_forward_and_backward(options, mask):
    """In float64: the fused path (with gradients and without: other SDPA kernels) and the reference path."""
    fused, reference = make_pair(torch.float64, **options)
    x = layer_normed(2, 11, 48).double() * 2
    kwargs, additive = masks(11)[mask]
    expected = explicit_attention(reference, x, additive)
    torch.testing.assert_close(fused(x, **kwargs), expected)
    torch.testing.assert_close(reference(x, **kwargs), expected)
    with torch.no_grad():
        torch.testing.assert_close(fused(x, **kwargs), expected)
    g = torch.randn_like(expected)
    for a, b in zip(grads(fused, x, g, **kwargs), grads(reference, x, g, **kwargs)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize('sharpen', [1., 50.])
def test_weights_stay_within_a_percent_of_float64_under_bf16(sharpen):
    """q, k and v as a bf16 projection gives them, widths at 1x and 50x their init, against the weights computed in
    float64 from the same q and k; with v the identity the output is the weight matrix. Were the key-norm term rounded
    to one bf16 number, at 50x it would be off by up to 100 / 256 in the logits."""
    torch.manual_seed(0)
    heads, tokens, head_dim = 3, 64, 64
    layer = HyperBFAttention(192, num_heads=heads)
    with torch.no_grad():
        q, k, _ = layer.qkv(layer_normed(2, tokens, 192)).bfloat16().reshape(2, tokens, 3, heads, head_dim).permute(
            2, 0, 3, 1, 4)
    gamma = layer.kernel.gamma().reshape(-1, 1, 1) * sharpen
    exact = torch.softmax(-gamma.double() * torch.cdist(q.double(), k.double()).square(), dim=-1)
    identity = torch.eye(tokens, head_dim, dtype=torch.bfloat16).expand(2, heads, tokens, head_dim)
    for grad in (True, False):  # SDPA's kernels for training and for inference
        with torch.set_grad_enabled(grad):
            weights = gaussian_sdpa(q.clone().requires_grad_(grad), k, identity, gamma)
        assert (weights.double() - exact).norm() <= 1e-2 * exact.norm()


@pytest.mark.parametrize('grad', [True, False], ids=['training', 'inference'])
def test_the_fused_path_builds_no_token_by_token_matrix_and_writes_into_no_tensor_a_submodule_returned(grad):
    attn = HyperBFAttention(48, num_heads=3)
    kept = []  # what the projection returned, and a copy of it
    attn.qkv.register_forward_hook(lambda module, args, out: kept.append((out, out.detach().clone())))
    with ShapeRecorder() as recorder, torch.set_grad_enabled(grad):
        out = attn(layer_normed(2, 29, 48))
        if grad:
            out.sum().backward()
    assert not [s for s in recorder.shapes if len(s) >= 2 and s[-2:] == (29, 29)]
    assert torch.equal(*kept[0])


@pytest.mark.parametrize('dropout', ['attn_drop', 'proj_drop'])
@pytest.mark.parametrize('path', ['fused', 'reference'])
def test_dropout_acts_in_training_only_and_keeps_the_expected_output(path, dropout):
    """Attention weights (``attn_drop``) or outputs (``proj_drop``): :func:`dropout_matches_its_expectation`."""
    plain, with_dropout = make_pair()[path == 'reference'], make_pair(**{dropout: .5})[path == 'reference']
    dropout_matches_its_expectation(with_dropout, plain, layer_normed(1, 9, 48).expand(4000, -1, -1))


def test_timm_block_drives_the_layer_with_its_arguments():
    torch.manual_seed(0)
    block = Block(48, 3, qkv_bias=True, qk_norm=True, scale_attn_norm=True, attn_layer=HyperBFAttention)
    x = layer_normed(2, 9, 48)
    assert isinstance(block.attn, HyperBFAttention) and not isinstance(block.attn.q_norm, torch.nn.Identity)
    causal = block(x, attn_mask=torch.full((9, 9), float('-inf')).triu(1))
    torch.testing.assert_close(causal[:, :4], block(x[:, :4], attn_mask=torch.full((4, 4), float('-inf')).triu(1)))


def test_the_reference_path_serves_where_timms_fused_attention_is_off():
    set_fused_attn(False)
    try:
        assert not HyperBFAttention(48, num_heads=3).fused_attn
    finally:
        set_fused_attn(True)


def record_sdpa_widths(monkeypatch) -> list:
    """The widths and dtype of q, k and v at every call of ``F.scaled_dot_product_attention`` from now on."""
    widths = []
    sdpa = F.scaled_dot_product_attention

    def recording_sdpa(q, k, v, *args, **kwargs):
        widths.append((q.shape[-1], k.shape[-1], v.shape[-1], q.dtype))
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, 'scaled_dot_product_attention', recording_sdpa)
    return widths


@pytest.mark.parametrize('dtype, unpadded', [(torch.float32, 65), (torch.bfloat16, 66), (torch.float16, 66)])
def test_the_fused_path_pads_q_k_and_v_to_a_multiple_of_8_which_changes_nothing_but_the_width(dtype, unpadded,
                                                                                              monkeypatch):
    """A head width of 64 takes one key-norm channel in float32 and two in half precision (the term and its rounding
    error): 65 or 66 wide, padded by default to 72, the widths CUDA's half-precision kernels take.
    ``channel_multiple=1`` (no padding) computes the same attention and gradients."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 9, 64, dtype=dtype, requires_grad=True) for _ in range(3))
    gamma = torch.rand(3, 1, 1) / 8
    widths = record_sdpa_widths(monkeypatch)
    outputs, grads = [], []
    for multiple in (8, 1):
        out = gaussian_sdpa(q, k, v, gamma, **({} if multiple == 8 else dict(channel_multiple=1)))
        outputs.append(out)
        grads.append(torch.autograd.grad(out.float().square().sum(), (q, k, v)))
    assert widths == [(72, 72, 72, dtype), (unpadded,) * 3 + (dtype,)]
    tolerance = {} if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)  # float32: its rounding alone
    torch.testing.assert_close(outputs[1], outputs[0], **tolerance)
    for padded, plain in zip(*grads):
        torch.testing.assert_close(plain, padded, **tolerance)


@pytest.mark.parametrize('fused', [True, False], ids=['fused', 'reference'])
def test_a_mask_together_with_is_causal_is_refused_on_both_paths(fused):
    """As recent F.scaled_dot_product_attention refuses them: the causal mask belongs in attn_mask to combine them."""
    attn = HyperBFAttention(48, num_heads=3)
    attn.fused_attn = fused
    with pytest.raises(ValueError, match='attn_mask and is_causal'):
        attn(layer_normed(2, 9, 48), attn_mask=torch.ones(9, 9, dtype=torch.bool), is_causal=True)


@pytest.mark.parametrize('kwargs, named', [
    (dict(dim=50, num_heads=3), r'num_heads must be a divisor of dim \(50\), got 3'),
    (dict(num_heads=0), 'num_heads .*got 0'),
    (dict(qk_norm=True), 'qk_norm and scale_norm need a norm_layer'),
    (dict(gamma_init=0.), 'gamma_init .*got 0.0'),
    (dict(gamma_init=float('nan')), 'gamma_init .*got nan'),
])
def test_a_bad_argument_raises_naming_it_and_its_value(kwargs, named):
    with pytest.raises(ValueError, match=named):
        HyperBFAttention(**dict(dict(dim=48, num_heads=3), **kwargs))


@pytest.mark.slow
@pytest.mark.parametrize('mask', ['none', 'boolean', 'causal'])
@pytest.mark.parametrize('fused', [True, False], ids=['fused', 'reference'])
def test_scripted_and_traced_layers_give_the_eager_outputs_and_gradients(fused, mask):
    """TorchScript, and torch.fx with the mask arguments as graph inputs (as it traces a model for timm's features)."""
    attn = make_pair()[0 if fused else 1]
    x, g = layer_normed(2, 9, 48), torch.randn(2, 9, 48)
    kwargs = masks(9)[mask][0]
    for compiled in (torch.jit.script(attn), torch.fx.symbolic_trace(attn)):
        with torch.no_grad():
            torch.testing.assert_close(compiled(x, **kwargs), attn(x, **kwargs))
        for a, b in zip(grads(compiled, x, g, **kwargs), grads(attn, x, g, **kwargs)):
            torch.testing.assert_close(a, b)
