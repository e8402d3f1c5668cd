"""HyperBFKernel: K(x, t) = exp(-gamma ||W (x - t)||^2) (Gaussian) or exp(-gamma ||W (x - t)||) (Laplacian)."""
import math

import pytest
import torch

from timm_hbf.layers import HyperBFKernel
from timm_hbf.layers.hyperbf_kernel import _AugmentQKV, _GaussianUnits


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
    assert (mahalanobis.kernel_to_centers(t, t).diagonal() == 1).all()  # zero distance to itself


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
        HyperBFKernel(4, kernel='laplacian').dot_product_operands(*torch.randn(3, 2, 4), torch.ones(1))


def test_dot_product_operands_give_the_gaussian_softmax():
    torch.manual_seed(0)
    k = HyperBFKernel(6, num_widths=2)
    q, kk, v = torch.randn(3, 2, 5, 6), torch.randn(3, 2, 5, 6), torch.randn(3, 2, 5, 6)
    gamma = torch.tensor([0.2, 0.05]).reshape(2, 1, 1)
    assert k.dot_product_operands(q, kk, v, gamma)[0].shape[-1] == 6 + 1  # one extra channel on CPU
    q_aug, k_aug, v_aug = k.dot_product_operands(q, kk, v, gamma, pad_to=8)  # CUDA's flash kernels need 8k
    assert q_aug.shape[-1] == 8 and k_aug.shape == v_aug.shape == q_aug.shape
    weights = torch.softmax(-gamma * torch.cdist(q, kk).pow(2), dim=-1)
    torch.testing.assert_close(torch.softmax(q_aug @ k_aug.transpose(-1, -2), dim=-1), weights)
    torch.testing.assert_close(v_aug[..., :6], v)
    assert (v_aug[..., 6:] == 0).all()


def test_custom_backward_passes_match_autograd():
    torch.manual_seed(0)
    f64 = dict(dtype=torch.float64, requires_grad=True)
    a = (torch.rand(2, 5, 7, dtype=torch.float64) - 1.5).requires_grad_()
    x_sq, gamma = torch.rand(2, 5, 1, **f64), torch.rand(7, **f64)
    assert torch.autograd.gradcheck(lambda a, x_sq, g: _GaussianUnits.apply(a.clone(), x_sq, g), (a, x_sq, gamma))
    q, kk, v = (torch.randn(2, 3, 5, 6, **f64) for _ in range(3))
    for shape in [(3, 1, 1), (1, 1, 1)]:  # a width per head, one per layer
        gamma = (torch.rand(*shape, dtype=torch.float64) + 0.1).requires_grad_()
        assert torch.autograd.gradcheck(lambda q, k, v, g: _AugmentQKV.apply(q, k, v, g, 3), (q, kk, v, gamma))


def test_construction_on_meta_device():
    k = HyperBFKernel(4, num_widths=2, mahalanobis=True, device='meta')
    assert all(p.device.type == 'meta' for p in k.parameters())
