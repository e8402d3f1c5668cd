"""HyperBFAttention: per head, softmax_j(-gamma_h ||q_i - k_j||^2) v_j (memo Eq. 6), fused and reference paths."""
import math

import pytest
import torch
from timm.layers import set_fused_attn

from timm_hbf.layers import HyperBFAttention, hyperbf_kernel

from ..helpers import ShapeRecorder, layer_normed, saved_activation_bytes


def make_pair(**kwargs):
    """The same attention layer twice: fused path and reference path."""
    torch.manual_seed(0)
    fused = HyperBFAttention(48, num_heads=3, qkv_bias=True, **kwargs)
    reference = HyperBFAttention(48, num_heads=3, qkv_bias=True, **kwargs)
    reference.load_state_dict(fused.state_dict())
    reference.fused_attn = False
    with torch.no_grad():  # distinct widths per head, away from init
        for m in (fused, reference):
            m.kernel.log_gamma.copy_(torch.linspace(-3., -1., m.kernel.log_gamma.numel()))
    assert fused.fused_attn
    return fused, reference


def explicit_attention(attn, x):
    """The formula, written out with cdist."""
    B, N, C = x.shape
    q, k, v = attn.qkv(x).reshape(B, N, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4)
    q, k = attn.kernel.project(q), attn.kernel.project(k)
    weights = torch.softmax(-attn.kernel.gamma().reshape(-1, 1, 1) * torch.cdist(q, k).pow(2), dim=-1)
    return attn.proj((weights @ v).transpose(1, 2).reshape(B, N, C))


def grads(module, x, out_grad):
    module.zero_grad()
    x = x.clone().requires_grad_()
    module(x).backward(out_grad)
    return [x.grad] + [p.grad for p in module.parameters()]


# CPU training writes the weights out up to 4 x head_dim tokens (here 64), and runs the fused kernel past that
TRAINING_PATHS = pytest.mark.parametrize('tokens', [17, 67], ids=['written_out_weights', 'fused_kernel'])


@TRAINING_PATHS
@pytest.mark.parametrize('gamma_per_head', [True, False])
@pytest.mark.parametrize('mahalanobis', [False, True])
def test_fused_and_reference_agree_in_fp32(gamma_per_head, mahalanobis, tokens):
    fused, reference = make_pair(gamma_per_head=gamma_per_head, mahalanobis=mahalanobis)
    x = layer_normed(2, tokens, 48) * 2
    out_fused, out_ref = fused(x), reference(x)
    assert (out_fused - out_ref).abs().max() <= 1e-5
    torch.testing.assert_close(out_ref, explicit_attention(reference, x), atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out_fused)
    for a, b in zip(grads(fused, x, g), grads(reference, x, g)):
        # 1e-5 absolute on O(1) values; relative on gradients that sum over the batch, such as the metric's
        assert (a - b).abs().max() <= 1e-5 * max(1., b.abs().max().item())


@pytest.mark.parametrize('gamma_per_head', [True, False])
@pytest.mark.parametrize('mahalanobis', [False, True])
def test_fused_and_reference_agree_in_inference(gamma_per_head, mahalanobis):
    """Without gradients the fused path attends with the key-norm term as a mask (on CPU): the same function."""
    fused, reference = make_pair(gamma_per_head=gamma_per_head, mahalanobis=mahalanobis)
    fused.eval(), reference.eval()
    x = layer_normed(2, 17, 48) * 2
    with torch.inference_mode():
        out_ref = reference(x)
        assert (fused(x) - out_ref).abs().max() <= 1e-5
        with torch.autocast('cpu', dtype=torch.bfloat16):
            out_bf16 = fused(x)
    assert out_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(out_bf16.float(), out_ref, atol=3e-2, rtol=3e-2)


@TRAINING_PATHS
def test_fused_and_reference_agree_under_bf16_autocast(tokens):
    fused, reference = make_pair()
    x = layer_normed(2, tokens, 48)
    g = torch.randn(2, tokens, 48)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out_fused, out_ref = fused(x), reference(x)
        grads_fused, grads_ref = grads(fused, x, g), grads(reference, x, g)
    assert out_fused.dtype == out_ref.dtype == torch.bfloat16
    torch.testing.assert_close(out_fused.float(), out_ref.float(), atol=3e-2, rtol=3e-2)
    for a, b in zip(grads_fused, grads_ref):
        assert torch.isfinite(a).all()
        assert (a.float() - b.float()).norm() <= 0.05 * b.float().norm() + 1e-3


def test_init_logits_have_the_scale_of_scaled_dot_product_attention():
    attn = HyperBFAttention(64, num_heads=4)
    gamma = attn.kernel.gamma()
    # -gamma ||q - k||^2 = 2 gamma q.k - gamma ||q||^2 - gamma ||k||^2; the q.k term is q.k / sqrt(head_dim)
    torch.testing.assert_close(2 * gamma, torch.full((4,), 1 / math.sqrt(16)))


def test_fused_path_builds_no_token_by_token_matrix_for_inference_or_long_sequences():
    attn = HyperBFAttention(48, num_heads=3)
    x = layer_normed(2, 67, 48)  # more than 4 x head_dim tokens
    with ShapeRecorder() as recorder:
        attn(x).sum().backward()
        with torch.no_grad():
            attn(x[:, :29])
    assert not [s for s in recorder.shapes if len(s) >= 2 and s[-2:] in ((67, 67), (29, 29))]


def test_written_out_weights_keep_no_more_than_the_fused_kernel_at_the_cifar_size(monkeypatch):
    """vit_hyperbf_tiny at 32x32 with patch 4: 65 tokens, width 192, 3 heads of 64. The weights (3 x 65 x 65 a
    sample) take the place of the augmented q, k and v (and the output) that the fused kernel keeps."""
    attn = HyperBFAttention(192, num_heads=3, qkv_bias=True)
    x = layer_normed(2, 65, 192).requires_grad_()
    with ShapeRecorder() as recorder:
        written_out = saved_activation_bytes(attn, x)
    assert (2, 65, 65) in recorder.shapes
    monkeypatch.setattr(hyperbf_kernel, 'explicit_weights_pay', lambda qkv: False)
    with ShapeRecorder() as recorder:
        fused = saved_activation_bytes(attn, x)
    assert (2, 65, 65) not in recorder.shapes
    assert written_out <= fused


def test_reference_path_serves_when_fused_attention_is_off_and_for_laplacian():
    set_fused_attn(False)
    try:
        assert not HyperBFAttention(48, num_heads=3).fused_attn
    finally:
        set_fused_attn(True)
    laplacian = HyperBFAttention(48, num_heads=3, kernel='laplacian')
    assert not laplacian.fused_attn
    out = laplacian(layer_normed(2, 9, 48))
    assert out.shape == (2, 9, 48) and torch.isfinite(out).all()


def test_one_width_per_head_or_per_layer():
    assert HyperBFAttention(48, num_heads=3).kernel.log_gamma.shape == (3,)
    assert HyperBFAttention(48, num_heads=3, gamma_per_head=False).kernel.log_gamma.shape == (1,)


def test_heads_must_divide_dim():
    with pytest.raises(ValueError, match=r'dim \(50\) must be divisible by num_heads \(3\)'):
        HyperBFAttention(50, num_heads=3)


def test_scripted_layer_gives_the_outputs_and_gradients_of_the_eager_one():
    fused, _ = make_pair()
    scripted = torch.jit.script(fused)
    x = layer_normed(2, 17, 48)
    g = torch.randn(2, 17, 48)
    torch.testing.assert_close(scripted(x), fused(x))
    with torch.no_grad():
        torch.testing.assert_close(scripted(x), fused(x))
    for a, b in zip(grads(scripted, x, g), grads(fused, x, g)):
        torch.testing.assert_close(a, b)
