"""HyperBFKernel: K(x, t) = exp(-gamma ||W (x - t)||^2) (Gaussian) or exp(-gamma ||W (x - t)||) (Laplacian)."""
import math

import pytest
import torch

from timm_hbf.layers import HyperBFKernel, log_gaussian


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
def test_log_kernel_matches_the_definition(kernel, mahalanobis):
    torch.manual_seed(0)
    k = HyperBFKernel(8, num_widths=5, gamma_init=0.05, kernel=kernel, mahalanobis=mahalanobis, dtype=torch.float64)
    with torch.no_grad():
        k.log_gamma.uniform_(-4, -1)
        if mahalanobis:
            k.metric.add_(0.3 * torch.randn_like(k.metric))
    x, t = torch.randn(7, 8, dtype=torch.float64), torch.randn(5, 8, dtype=torch.float64)
    expected = brute_force_kernel(x, t, k.gamma(), k.metric, kernel)
    torch.testing.assert_close(k.log_kernel(k.project(x), k.project(t), k.gamma().unsqueeze(0)).exp(), expected)


def test_under_bf16_autocast_the_product_alone_is_rounded():
    """The norms and the sum in float32: every distance is off by no more than the rounding of the bf16 product
    ``2 gamma x.t``, 2^-8 of ``2 gamma |x| |t|``, also where points lie next to centres and the terms (each about
    200) cancel. A bf16 sum of the three would be off by up to gamma ||x||^2 / 256."""
    torch.manual_seed(0)
    x = torch.nn.functional.layer_norm(torch.randn(64, 192), (192,))
    t = torch.cat([x[:16] + 0.01 * torch.randn(16, 192), torch.randn(16, 192)])
    gamma = torch.full((1, 32), 50. / (2 * 192))  # 50 times the HyperBF MLP's initial width
    exact = log_gaussian(x.double(), t.double(), gamma.double())
    with torch.autocast('cpu', dtype=torch.bfloat16):
        under_autocast = log_gaussian(x, t, gamma)
    assert under_autocast.dtype == torch.float32
    bound = 2 ** -8 * 2 * gamma.double() * x.double().norm(dim=-1, keepdim=True) * t.double().norm(dim=-1)
    assert ((under_autocast.double() - exact).abs() <= bound).all()
    torch.testing.assert_close(log_gaussian(x, t, gamma).double(), exact, atol=1e-4, rtol=1e-5)  # float32 without


def test_mahalanobis_starts_as_the_plain_rbf_and_any_factor_gives_a_valid_kernel():
    torch.manual_seed(0)
    plain, mahalanobis = HyperBFKernel(6, num_widths=3), HyperBFKernel(6, num_widths=3, mahalanobis=True)
    x, t = torch.randn(4, 6), torch.randn(3, 6)

    def kernel(k, x, t):
        return k.log_kernel(k.project(x), k.project(t), k.gamma().unsqueeze(0)).exp()

    torch.testing.assert_close(kernel(mahalanobis, x, t), kernel(plain, x, t))
    with torch.no_grad():
        mahalanobis.metric.copy_(torch.randn(6, 6))  # any W: the metric W^T W is positive semi-definite
    values = kernel(mahalanobis, x, t)
    assert (values >= 0).all() and (values <= 1 + 1e-6).all()
    torch.testing.assert_close(kernel(mahalanobis, t, t).diagonal(), torch.ones(3))  # zero distance


def test_gamma_is_log_parametrised_and_init_weights_restores_the_init():
    k = HyperBFKernel(3, num_widths=2, gamma_init=0.25, mahalanobis=True)
    torch.testing.assert_close(k.log_gamma, torch.full((2,), math.log(0.25)))
    with torch.no_grad():
        k.log_gamma.zero_()
        k.metric.zero_()
    k.init_weights()
    torch.testing.assert_close(k.gamma(), torch.full((2,), 0.25))
    torch.testing.assert_close(k.metric, torch.eye(3))


@pytest.mark.parametrize('lr', [1e3, 1e8])
def test_gamma_stays_positive_and_finite_after_a_huge_step(lr):
    torch.manual_seed(0)
    k = HyperBFKernel(4, num_widths=3, gamma_init=0.1)
    x, t = torch.randn(5, 4), torch.randn(3, 4)
    for sign in (1., -1.):  # push gamma both ways
        opt = torch.optim.SGD(k.parameters(), lr=lr)
        (sign * k.log_kernel(x, t, k.gamma().unsqueeze(0)).exp().sum()).backward()
        opt.step()
        opt.zero_grad()
        assert (k.gamma() > 0).all() and torch.isfinite(k.gamma()).all()
        assert torch.isfinite(k.log_kernel(x, t, k.gamma().unsqueeze(0))).all()


def test_laplacian_gradient_is_finite_at_zero_distance():
    k = HyperBFKernel(4, num_widths=1, kernel='laplacian')
    x = torch.randn(3, 4, requires_grad=True)
    k.log_kernel(x, x.detach(), k.gamma().unsqueeze(0)).sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize('name, value, error, named', [
    ('kernel', 'cauchy', ValueError, "kernel .*'cauchy'"),
    ('gamma_init', 0., ValueError, 'gamma_init .*got 0.0'),
    ('gamma_init', float('inf'), ValueError, 'gamma_init .*got inf'),
    ('gamma_init', '0.1', TypeError, "gamma_init .*got '0.1'"),
    ('eps', 0., ValueError, 'eps .*got 0.0'),
    ('num_widths', 0, ValueError, 'num_widths .*got 0'),
    ('num_widths', 2.5, TypeError, 'num_widths .*got 2.5'),
])
def test_a_bad_argument_raises_naming_it_and_its_value(name, value, error, named):
    with pytest.raises(error, match=named):
        HyperBFKernel(4, **{name: value})
