"""HyperBFKernel: K(x, t) = exp(-gamma ||W (x - t)||^2) (Gaussian) or exp(-gamma ||W (x - t)||) (Laplacian)."""
import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from timm_hbf.layers import HyperBFKernel
from timm_hbf.layers.hyperbf_kernel import (
    _AugmentPoints,
    _AugmentQKV,
    _GaussianAttentionPerHead,
    _GaussianUnits,
    augment_points,
    augment_qkv,
    explicit_weights_pay,
)

from ..helpers import ShapeRecorder


def brute_force_kernel(x, t, gamma, metric=None, kernel='gaussian'):
    """K(x_i, t_j) from explicit differences: (N, D), (M, D), (M,) -> (N, M)."""
    diff = x[:, None, :] - t[None, :, :]
    if metric is not None:
        diff = diff @ metric.t()
    dist_sq = diff.pow(2).sum(-1)
    dist = dist_sq if kernel == 'gaussian' else dist_sq.sqrt()
    return torch.exp(-gamma * dist)


@pytest.mark.parametrize('kernel', ['gaussian', 'laplacian'])
@pytest.mark.parametrize('mahalanobis', [False, True])
def test_kernel_to_centers_matches_definition(kernel, mahalanobis):
    torch.manual_seed(0)
    k = HyperBFKernel(8, num_widths=5, gamma_init=0.05, kernel=kernel, mahalanobis=mahalanobis, dtype=torch.float64)
    with torch.no_grad():
        k.log_gamma.uniform_(-4, -1)
        if mahalanobis:
            k.metric.add_(0.3 * torch.randn_like(k.metric))
    x, t = torch.randn(7, 8, dtype=torch.float64), torch.randn(5, 8, dtype=torch.float64)
    expected = brute_force_kernel(x, t, k.gamma(), k.metric, kernel)
    torch.testing.assert_close(k.kernel_to_centers(x, t), expected)
    torch.testing.assert_close(k.log_kernel_to_centers(x, t).exp(), expected)
    torch.testing.assert_close(k.log_kernel(k.project(x), k.project(t), k.gamma()).exp(), expected)


def test_mahalanobis_starts_as_the_plain_rbf_and_any_factor_gives_a_valid_kernel():
    torch.manual_seed(0)
    plain, mahalanobis = HyperBFKernel(6, num_widths=3), HyperBFKernel(6, num_widths=3, mahalanobis=True)
    x, t = torch.randn(4, 6), torch.randn(3, 6)
    torch.testing.assert_close(mahalanobis.kernel_to_centers(x, t), plain.kernel_to_centers(x, t))
    with torch.no_grad():
        mahalanobis.metric.copy_(torch.randn(6, 6))  # any W: the metric W^T W is positive semi-definite
    values = mahalanobis.kernel_to_centers(x, t)
    assert ((values >= 0) & (values <= 1)).all()
    torch.testing.assert_close(mahalanobis.kernel_to_centers(t, t).diagonal(), torch.ones(3))  # zero distance


def test_gamma_is_log_parametrised():
    k = HyperBFKernel(4, num_widths=3, gamma_init=0.25)
    assert k.log_gamma.shape == (3,)
    torch.testing.assert_close(k.gamma(), torch.full((3,), 0.25))
    torch.testing.assert_close(k.log_gamma, torch.full((3,), math.log(0.25)))


@pytest.mark.parametrize('lr', [1e3, 1e8])
def test_gamma_stays_positive_and_finite_after_a_huge_step(lr):
    torch.manual_seed(0)
    k = HyperBFKernel(4, num_widths=3, gamma_init=0.1)
    x, t = torch.randn(5, 4), torch.randn(3, 4)
    for sign in (1., -1.):  # push gamma both ways
        opt = torch.optim.SGD(k.parameters(), lr=lr)
        (sign * k.kernel_to_centers(x, t).sum()).backward()
        opt.step()
        opt.zero_grad()
        assert (k.gamma() > 0).all() and torch.isfinite(k.gamma()).all()
        assert torch.isfinite(k.kernel_to_centers(x, t)).all()


def test_unknown_kernel_and_bad_gamma_are_rejected():
    with pytest.raises(ValueError, match="Unknown HyperBF kernel 'cauchy'"):
        HyperBFKernel(4, kernel='cauchy')
    with pytest.raises(ValueError, match='gamma_init must be positive'):
        HyperBFKernel(4, gamma_init=0.)
    with pytest.raises(RuntimeError, match='dot-product form'):
        HyperBFKernel(4, kernel='laplacian').dot_product_attention(torch.randn(2, 5, 3, 1, 4), torch.ones(1))


def test_augmented_qkv_give_the_gaussian_softmax():
    torch.manual_seed(0)
    qkv = torch.randn(3, 5, 3, 2, 6)  # (B, N, q/k/v, H, D), as a qkv projection makes them
    gamma = torch.tensor([0.2, 0.05]).reshape(2, 1, 1)
    assert augment_qkv(qkv, gamma, pad_to=0)[0].shape[-1] == 6 + 1  # one extra channel on CPU
    q_aug, k_aug, v_aug = augment_qkv(qkv, gamma, pad_to=8)  # CUDA's flash kernels need 8k
    assert q_aug.shape == (3, 2, 5, 8) and k_aug.shape == v_aug.shape == q_aug.shape
    q, k, v = qkv.permute(2, 0, 3, 1, 4)
    weights = torch.softmax(-gamma * torch.cdist(q, k).pow(2), dim=-1)
    torch.testing.assert_close(torch.softmax(q_aug @ k_aug.transpose(-1, -2), dim=-1), weights)
    torch.testing.assert_close(v_aug[..., :6], v)
    assert (v_aug[..., 6:] == 0).all()


def explicit_gaussian_attention(kernel, qkv, gamma):
    """softmax_j(-gamma_h ||q_i - k_j||^2) v_j from the explicit distances, for qkv of shape (B, N, 3, H, D)."""
    q, k, v = qkv.permute(2, 0, 3, 1, 4)
    return torch.softmax(kernel.log_kernel(q, k, gamma.reshape(-1, 1, 1)), dim=-1) @ v


@pytest.mark.parametrize('grad, tokens, pad_to, path_shape', [
    (True, 5, 0, (3, 5, 5)),  # a (B, N, N) weight matrix per head
    (True, 25, 0, (3, 2, 25, 7)),  # (B, H, N, D + 1), past 4 x head_dim tokens
    (True, 25, 8, (3, 2, 25, 8)),
    (False, 5, 0, (3, 2, 1, 5)),  # (B, H, 1, N)
], ids=['explicit_weights', 'key_norm_channel', 'key_norm_channel_cuda_width', 'key_norm_mask'])
@pytest.mark.parametrize('num_widths', [2, 1])
def test_dot_product_attention_is_the_gaussian_attention(num_widths, grad, tokens, pad_to, path_shape):
    torch.manual_seed(0)
    kernel = HyperBFKernel(6, num_widths=num_widths)
    qkv = torch.randn(3, tokens, 3, 2, 6, requires_grad=grad)
    gamma = torch.tensor([0.2, 0.05])[:num_widths]
    expected = explicit_gaussian_attention(kernel, qkv, gamma)
    with torch.set_grad_enabled(grad), ShapeRecorder() as recorder:
        out = kernel.dot_product_attention(qkv, gamma, pad_to=pad_to)
    torch.testing.assert_close(out, expected)
    assert path_shape in recorder.shapes


def test_weights_are_written_out_for_cpu_training_up_to_four_head_widths_of_tokens():
    head_dim = 16
    assert explicit_weights_pay(torch.empty(2, 4 * head_dim, 3, 3, head_dim))
    assert not explicit_weights_pay(torch.empty(2, 4 * head_dim + 1, 3, 3, head_dim))
    assert not explicit_weights_pay(torch.empty(2, 4, 3, 3, head_dim, device='meta'))  # CPU only


def test_attention_dropout_takes_the_fused_kernel():
    kernel = HyperBFKernel(6, num_widths=2)
    qkv = torch.randn(3, 5, 3, 2, 6, requires_grad=True)
    with ShapeRecorder() as recorder:
        out = kernel.dot_product_attention(qkv, torch.tensor([0.2, 0.05]), dropout_p=0.5)
    out.sum().backward()
    assert (3, 2, 5, 7) in recorder.shapes and (3, 5, 5) not in recorder.shapes


def test_inference_on_cpu_runs_the_flash_kernel_with_the_key_norm_as_a_mask_row():
    torch.manual_seed(0)
    kernel = HyperBFKernel(16, num_widths=3)
    qkv, gamma = torch.randn(2, 37, 3, 3, 16), torch.tensor([0.2, 0.05, 0.1])
    expected = explicit_gaussian_attention(kernel, qkv, gamma)
    with torch.inference_mode(), sdpa_kernel([SDPBackend.FLASH_ATTENTION]), ShapeRecorder() as recorder:
        out = kernel.dot_product_attention(qkv.clone(), gamma)  # raises if the flash kernel cannot take it
    torch.testing.assert_close(out, expected)
    assert not [s for s in recorder.shapes if s[-2:] == (37, 37)]  # the mask is one (2, 3, 1, 37) row per query


def test_inplace_inference_scales_the_queries_of_qkv_and_nothing_else():
    torch.manual_seed(0)
    kernel = HyperBFKernel(16, num_widths=3)
    qkv, gamma = torch.randn(2, 37, 3, 3, 16), torch.tensor([0.2, 0.05, 0.1])
    given = qkv.clone()
    with torch.no_grad():
        expected = kernel.dot_product_attention(qkv, gamma)
        assert torch.equal(qkv, given)  # not in place unless asked
        torch.testing.assert_close(kernel.dot_product_attention(qkv, gamma, inplace=True), expected)
    torch.testing.assert_close(qkv[:, :, 0], given[:, :, 0] * 2. * gamma.reshape(3, 1))
    assert torch.equal(qkv[:, :, 1:], given[:, :, 1:])
    grad_qkv = given.clone().requires_grad_()
    kernel.dot_product_attention(grad_qkv, gamma, inplace=True)  # a gradient may be needed: never in place
    assert torch.equal(grad_qkv.detach(), given)


def test_custom_backward_passes_match_autograd():
    torch.manual_seed(0)
    f64 = dict(dtype=torch.float64, requires_grad=True)
    log_k = (torch.rand(2, 5, 7, dtype=torch.float64) - 1.5).requires_grad_()
    assert torch.autograd.gradcheck(lambda log_k: _GaussianUnits.apply(log_k.clone()), (log_k,))
    qkv = torch.randn(2, 5, 3, 3, 6, **f64)  # (B, N, q/k/v, H, D)
    for shape in [(3, 1, 1), (1, 1, 1)]:  # a width per head, one per layer
        gamma = (torch.rand(*shape, dtype=torch.float64) + 0.1).requires_grad_()
        assert torch.autograd.gradcheck(lambda qkv, g: _AugmentQKV.apply(qkv, g, 3), (qkv, gamma))
        assert torch.autograd.gradcheck(_GaussianAttentionPerHead.apply, (qkv, gamma))
    points = torch.randn(7, 5, **f64)
    for pad in (0, 3):
        assert torch.autograd.gradcheck(lambda x: _AugmentPoints.apply(x, pad), (points,))


def test_augmented_points_carry_the_squared_norm_and_a_one():
    x = torch.randn(4, 5)
    x_aug = augment_points(x, pad=3)
    assert x_aug.shape == (4, 10)
    assert torch.equal(x_aug[:, :5], x)
    torch.testing.assert_close(x_aug[:, 5], (x * x).sum(-1))
    assert torch.equal(x_aug[:, 6], torch.ones(4)) and torch.equal(x_aug[:, 7:], torch.zeros(4, 3))
    t = torch.randn(6, 5)  # [2 t, -1, -||t||^2, 0...] against them gives minus the squared distance
    t_aug = torch.cat([2. * t, -torch.ones(6, 1), -(t * t).sum(-1, keepdim=True), torch.zeros(6, 3)], dim=-1)
    torch.testing.assert_close(x_aug @ t_aug.t(), -torch.cdist(x, t).square(), atol=1e-4, rtol=1e-4)


def test_construction_on_meta_device():
    k = HyperBFKernel(4, num_widths=2, mahalanobis=True, device='meta')
    assert all(p.device.type == 'meta' for p in k.parameters())
