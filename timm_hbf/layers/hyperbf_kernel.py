"""The HyperBF kernel shared by every HyperBF layer (CBMM Memo 143, Eq. 4).

    K(x, t) = exp(-gamma * ||W (x - t)||^2)        Gaussian (default); gamma = 1 / (2 sigma^2)
    K(x, t) = exp(-gamma * ||W (x - t)||)          Laplacian (memo, footnote 1)

``gamma`` is learned through its logarithm, so it stays positive whatever the optimizer does. ``W`` is the optional
Mahalanobis factor: the metric ``W^T W`` is positive semi-definite by construction and starts at the identity, where
the kernel is the plain radial basis function. Memo Eq. 4 gives every centre a metric ``W_i`` of its own; a layer here
shares one, as the authors' code does: a ``D x D`` metric per centre would hold ``M D^2`` parameters (1.8 billion for
the memo's 3000 centres of width 768) and cost a ``D x D`` product per token and centre.

Distances are never formed from ``x[:, None] - t[None]`` differences: ``||x - t||^2 = ||x||^2 + ||t||^2 - 2 x.t``
turns them into one matrix product, which is what lets HyperBF layers cost what their dot-product counterparts cost.
"""
import math
from typing import Optional

import torch
import torch.fx
from torch import nn
from torch.jit import Final

from .._checks import check_choice, check_count, check_positive

__all__ = ['HyperBFKernel', 'KERNELS', 'log_gaussian']

KERNELS = ('gaussian', 'laplacian')
LOG_GAMMA_BOUND = 60.  # exp(+-60) is finite and non-zero in fp32 and bf16


def accumulation_dtype(x: torch.Tensor) -> torch.dtype:
    """float32, or float64 for float64 ``x``: the dtype that distances, kernel logits and the sums over them are
    computed in, whatever the inputs' dtype (also under autocast)."""
    return torch.promote_types(x.dtype, torch.float32)


def _log_gaussian(x: torch.Tensor, t: torch.Tensor, gamma: torch.Tensor, low: Optional[torch.dtype]) -> torch.Tensor:
    dtype = accumulation_dtype(x)
    x, t, gamma = x.to(dtype), t.to(dtype), gamma.to(dtype)
    two_gamma_t = t * (2. * gamma).transpose(-1, -2)  # 2 gamma_j t_j, (..., M, D)
    t_term = torch.linalg.vecdot(two_gamma_t, t).unsqueeze(-2) * -.5  # -gamma_j ||t_j||^2, (..., 1, M)
    x_sq = torch.linalg.vecdot(x, x).unsqueeze(-1)  # (..., N, 1)
    if low is None:
        cross = x @ two_gamma_t.transpose(-1, -2)
    else:  # under autocast the product runs in its dtype: the one large operation, its sum rounded once
        cross = (x.to(low) @ two_gamma_t.to(low).transpose(-1, -2)).to(dtype)
    # the terms go into the product's fresh output, which autograd does not keep
    return cross.add_(t_term).addcmul_(x_sq, gamma, value=-1.)


def log_gaussian(x: torch.Tensor, t: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """``-gamma_j ||x_i - t_j||^2`` for all pairs: ``(..., N, D), (..., M, D) -> (..., N, M)``, in float32 (or wider).

    ``gamma`` broadcasts against the result with a 1 in its ``N`` dimension: ``(1, M)`` for one width per centre,
    ``(H, 1, 1)`` for one per head. The square is expanded, ``2 gamma x.t - gamma ||t||^2 - gamma ||x||^2``: one
    matrix product with ``gamma`` on ``t``, plus two norms.

    The norms and the sum of the three terms are float32, also under autocast, where the product ``2 gamma x.t``
    runs in the autocast dtype: its relative rounding (``2^-9`` in bf16) scales with ``gamma``, not with the distance's
    terms, which a bf16 sum of the three would lose where points lie near centres.
    """
    if not torch.jit.is_scripting():
        if x.device.type != 'meta':  # autocast has no meta device (a call to ask breaks torch 2.11's graph)
            device = x.device.type
            low = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
            with torch.autocast(device, enabled=False):
                return _log_gaussian(x, t, gamma, low)
    return _log_gaussian(x, t, gamma, None)


# a leaf for torch.fx: a symbolic trace cannot take the autocast context's device from a traced tensor
torch.fx.wrap('log_gaussian')


class HyperBFKernel(nn.Module):
    """Radial basis kernel with learned widths and an optional learned Mahalanobis metric (memo Eq. 4).

    Args:
        dim: Feature dimension of the points and centres.
        num_widths: Number of independent widths (one per head, per centre, or 1 for the whole layer).
        gamma_init: Initial gamma (every width).
        kernel: ``'gaussian'`` or ``'laplacian'``.
        mahalanobis: Learn ``W`` (``dim x dim``, identity at init); distances become ``||W (x - t)||``.
        eps: Added under the Laplacian's square root, whose gradient is infinite at zero distance.
    """
    is_gaussian: Final[bool]
    log_gamma_bound: Final[float] = LOG_GAMMA_BOUND

    def __init__(
            self,
            dim: int,
            num_widths: int = 1,
            gamma_init: float = 1.0,
            kernel: str = 'gaussian',
            mahalanobis: bool = False,
            eps: float = 1e-6,
            device: torch.types.Device = None,
            dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        check_count('num_widths', num_widths)
        check_positive('gamma_init (the initial kernel width)', gamma_init)
        check_choice('kernel', kernel, KERNELS)
        check_positive("eps (the Laplacian's offset under the square root)", eps)
        dd = {'device': device, 'dtype': dtype}
        self.dim = dim
        self.kernel = kernel
        self.is_gaussian = kernel == 'gaussian'
        self.eps = eps
        self.gamma_init = gamma_init
        self.log_gamma = nn.Parameter(torch.empty(num_widths, **dd))
        self.metric = nn.Parameter(torch.empty(dim, dim, **dd)) if mahalanobis else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.log_gamma.fill_(math.log(self.gamma_init))
            if self.metric is not None:
                # copy_ rather than nn.init.eye_, which refuses tensors on the meta device
                self.metric.copy_(torch.eye(self.dim, device=self.metric.device, dtype=self.metric.dtype))

    def init_weights(self) -> None:
        """Called by the ViT weight init: the kernel keeps its own init, not the trunc-normal of Linears."""
        self.reset_parameters()

    def gamma(self) -> torch.Tensor:
        """The widths, shape ``(num_widths,)``: ``exp(log_gamma)``, with ``log_gamma`` held to ``[-60, 60]`` so that
        gamma stays strictly positive and finite in fp32 and bf16 whatever step an optimizer takes."""
        return self.log_gamma.clamp(-self.log_gamma_bound, self.log_gamma_bound).exp()

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """``x -> W x``: the space where the metric is Euclidean (identity without Mahalanobis)."""
        metric = self.metric
        if metric is None:
            return x
        return x @ metric.t().to(x.dtype)

    def log_kernel(self, x: torch.Tensor, t: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
        """``log K(x_i, t_j)`` for projected points: ``(..., N, D), (..., M, D) -> (..., N, M)``, float32 (or wider).

        ``gamma`` broadcasts against the result with a 1 in its ``N`` dimension (see :func:`log_gaussian`).
        """
        if self.is_gaussian:
            return log_gaussian(x, t, gamma)
        sq_dist = -log_gaussian(x, t, torch.ones_like(gamma))
        return -gamma * (sq_dist.clamp_min(0.) + self.eps).sqrt()

    def extra_repr(self) -> str:
        return f'dim={self.dim}, num_widths={self.log_gamma.numel()}, kernel={self.kernel}, ' \
               f'mahalanobis={self.metric is not None}'
