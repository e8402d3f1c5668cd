"""The HyperBF kernel shared by every HyperBF layer (CBMM Memo 143, Eq. 4).

    K(x, t) = exp(-gamma * ||W (x - t)||^2)        Gaussian (default); gamma = 1 / (2 sigma^2)
    K(x, t) = exp(-gamma * ||W (x - t)||)          Laplacian (memo, footnote 1)

``gamma`` is learned through its logarithm, so it stays positive whatever the optimizer does. ``W`` is the optional
Mahalanobis factor: the metric ``W^T W`` is positive semi-definite by construction and starts at the identity, where
the kernel is the plain radial basis function.

Distances are never formed from ``x[:, None] - t[None]`` differences: ``||x - t||^2 = ||x||^2 + ||t||^2 - 2 x.t``
turns them into one matrix product plus two norms, which is what lets HyperBF layers cost what their dot-product
counterparts cost. The two hot paths (Gaussian units against centres, Gaussian attention logits) have hand-written
backward passes that keep only what the next op saves anyway, so they use no more activation memory than a GELU MLP
and plain scaled-dot-product attention.
"""
import math
from typing import Tuple

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.jit import Final

__all__ = ['HyperBFKernel', 'KERNELS', 'distance_key', 'pairwise_sq_dist']

KERNELS = ('gaussian', 'laplacian')
LOG_GAMMA_BOUND = 60.  # exp(+-60) is finite and non-zero in fp32 and bf16


def pairwise_sq_dist(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``||x_i - t_j||^2`` for all pairs as one matrix product: ``(..., N, D), (..., M, D) -> (..., N, M)``."""
    x_sq = x.pow(2).sum(-1, keepdim=True)
    t_sq = t.pow(2).sum(-1).unsqueeze(-2)
    return (x_sq + t_sq - 2. * (x @ t.transpose(-1, -2))).clamp_min(0.)


# --- Gaussian units against centres: exp(min(a - gamma * ||x||^2, 0)) ------------------------------------------------

def _gaussian_log_units(a: torch.Tensor, x_sq: torch.Tensor, gamma: torch.Tensor, inplace: bool) -> torch.Tensor:
    """``min(a - x_sq * gamma, 0)``, overwriting ``a`` if ``inplace``; the cap only removes rounding error (a
    distance cannot be negative)."""
    x_sq, gamma = x_sq.to(a.dtype), gamma.to(a.dtype)
    if inplace:
        return a.addcmul_(x_sq, gamma, value=-1.).clamp_max_(0.)
    return torch.addcmul(a, x_sq, gamma, value=-1.).clamp_max(0.)


def _gaussian_units(a: torch.Tensor, x_sq: torch.Tensor, gamma: torch.Tensor, inplace: bool) -> torch.Tensor:
    """``exp(min(a - x_sq * gamma, 0))``, overwriting ``a`` if ``inplace``."""
    log_k = _gaussian_log_units(a, x_sq, gamma, inplace)
    return log_k.exp_() if inplace else log_k.exp()


class _GaussianUnits(torch.autograd.Function):
    """:func:`_gaussian_units` in place on ``a`` (a fresh ``linear`` output), saving only its output; the gradient
    passes the cap as if it were not there."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, x_sq: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
        out = _gaussian_units(a, x_sq, gamma, inplace=True)
        ctx.mark_dirty(a)
        ctx.save_for_backward(out, x_sq, gamma)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out, x_sq, gamma = ctx.saved_tensors
        grad_a = grad * out
        grad_x_sq = -(grad_a @ gamma.to(grad_a.dtype)).unsqueeze(-1)
        grad_gamma = -(x_sq.reshape(1, -1).to(grad_a.dtype) @ grad_a.reshape(-1, grad_a.shape[-1])).reshape(-1)
        return grad_a, grad_x_sq.to(x_sq.dtype), grad_gamma.to(gamma.dtype)


def gaussian_units(a: torch.Tensor, x_sq: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """``exp(min(a - x_sq * gamma, 0))`` for ``a (..., M)``, ``x_sq (..., 1)``, ``gamma (M,)``; may overwrite ``a``."""
    if torch.jit.is_scripting() or not torch.is_grad_enabled():
        return _gaussian_units(a, x_sq, gamma, inplace=not torch.is_grad_enabled())
    return _GaussianUnits.apply(a, x_sq, gamma)


# --- Gaussian attention as a dot product ------------------------------------------------------------------------------

def _augment_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gamma: torch.Tensor, pad: int) -> torch.Tensor:
    """One buffer ``(3, ..., N, D + pad)`` holding ``[q, 1, 1...]``, ``[2 gamma k, -gamma ||k||^2, 0...]`` and
    ``[v, 0...]``: one copy of q, k, v, then in-place fills."""
    dim = q.shape[-1]
    buf = q.new_empty((3,) + q.shape[:-1] + (dim + pad,))
    buf[0, ..., :dim] = q
    buf[0, ..., dim:] = 1.  # every pad channel of q is 1: only the first meets a non-zero key channel
    k_aug = buf[1]
    k_aug[..., :dim] = k
    k_aug[..., dim:dim + 1] = -gamma * k.pow(2).sum(-1, keepdim=True)
    k_aug[..., dim + 1:] = 0.
    k_aug[..., :dim] *= 2. * gamma
    buf[2, ..., :dim] = v
    buf[2, ..., dim:] = 0.
    return buf


class _AugmentQKV(torch.autograd.Function):
    """:func:`_augment_qkv` that saves only the augmented keys (which the attention kernel saves anyway) and gamma."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gamma: torch.Tensor, pad: int) -> torch.Tensor:
        buf = _augment_qkv(q, k, v, gamma, pad)
        ctx.pad = pad
        ctx.save_for_backward(buf[1], gamma)
        return buf

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        k_aug, gamma = ctx.saved_tensors
        dim = k_aug.shape[-1] - ctx.pad
        k = k_aug[..., :dim] / (2. * gamma)
        neg_k_sq = k_aug[..., dim:dim + 1] / gamma  # -||k||^2
        grad_main, grad_norm = grad[1, ..., :dim], grad[1, ..., dim:dim + 1]
        grad_k = (2. * gamma) * (grad_main - k * grad_norm)
        # d/dgamma of (2 gamma k . g_main - gamma ||k||^2 g_norm), summed to gamma's shape
        grad_gamma = (2. * k * grad_main).sum(-1, keepdim=True) + neg_k_sq * grad_norm
        return grad[0, ..., :dim], grad_k, grad[2, ..., :dim], grad_gamma.sum_to_size(gamma.shape), None


def augment_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gamma: torch.Tensor, pad_to: int) -> torch.Tensor:
    """:func:`_augment_qkv` to a width that is a multiple of ``pad_to`` (0: of 8 on CUDA, whose flash kernels need
    it, else any width), with a backward pass that keeps no more than the attention kernel keeps."""
    if pad_to <= 0:
        pad_to = 8 if q.is_cuda else 1
    pad = (-(q.shape[-1] + 1) % pad_to) + 1
    if torch.jit.is_scripting() or not torch.is_grad_enabled():
        return _augment_qkv(q, k, v, gamma, pad)
    return _AugmentQKV.apply(q, k, v, gamma, pad)


def distance_key(k: torch.Tensor) -> torch.Tensor:
    """``k -> [k, ||k||^2]``: keys for :meth:`HyperBFKernel.distance_query`."""
    return torch.cat([k, k.pow(2).sum(-1, keepdim=True)], dim=-1)


# Leaves for torch.fx: traced graphs call the functions (and so their custom backward) instead of tracing through them.
torch.fx.wrap('gaussian_units')
torch.fx.wrap('augment_qkv')


class HyperBFKernel(nn.Module):
    """Radial basis kernel with learned widths and an optional learned Mahalanobis metric.

    Evaluations that share the parameters:

    * :meth:`log_kernel`: the plain formula on a full distance matrix (reference path);
    * :meth:`log_kernel_to_centers` and :meth:`kernel_to_centers`: points against a fixed set of centres with one
      width per centre, as a single ``linear`` (the cost of an MLP's first layer);
    * :meth:`dot_product_operands`: Gaussian logits rewritten for fused scaled-dot-product attention.

    Args:
        dim: Feature dimension of the points and centres.
        num_widths: Number of independent widths (one per head, per centre, or 1 for the whole layer).
        gamma_init: Initial gamma (every width).
        kernel: ``'gaussian'`` or ``'laplacian'``.
        mahalanobis: Learn ``W`` (``dim x dim``, identity at init); distances become ``||W (x - t)||``.
        eps: Added under the Laplacian's square root, whose gradient is infinite at zero distance.
    """
    log_gamma_bound: Final[float] = LOG_GAMMA_BOUND

    def __init__(
            self,
            dim: int,
            num_widths: int = 1,
            gamma_init: float = 1.0,
            kernel: str = 'gaussian',
            mahalanobis: bool = False,
            eps: float = 1e-6,
            device=None,
            dtype=None,
    ) -> None:
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"Unknown HyperBF kernel '{kernel}': use one of {KERNELS}.")
        if not gamma_init > 0:
            raise ValueError(f'gamma_init must be positive, got {gamma_init}.')
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
        """Called by the model's weight init: the kernel keeps its own init, not the trunc-normal of Linears."""
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

    def _from_sq_dist(self, sq_dist: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
        if self.is_gaussian:
            return -gamma * sq_dist
        return -gamma * (sq_dist + self.eps).sqrt()

    def log_kernel(self, x: torch.Tensor, t: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
        """``log K(x_i, t_j)`` for projected points: ``(..., N, D), (..., M, D) -> (..., N, M)``.

        ``gamma`` broadcasts against the result (e.g. ``(H, 1, 1)`` for one width per head).
        """
        return self._from_sq_dist(pairwise_sq_dist(x, t), gamma)

    def _center_terms(
            self,
            x: torch.Tensor,
            centers: torch.Tensor,
            gamma: torch.Tensor,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``a = x . 2 gamma_i t_i - gamma_i ||t_i||^2`` and ``||x||^2``, so that
        ``-gamma_i ||x - t_i||^2 = a - gamma_i ||x||^2``."""
        x, centers = self.project(x), self.project(centers)
        a = F.linear(x, centers * (2. * gamma).unsqueeze(-1), -gamma * centers.pow(2).sum(-1))
        return a, x.pow(2).sum(-1, keepdim=True)

    def log_kernel_to_centers(self, x: torch.Tensor, centers: torch.Tensor) -> torch.Tensor:
        """``log K(x, t_i)`` against ``M`` centres with one width each: ``(..., D), (M, D) -> (..., M)``."""
        gamma = self.gamma()
        if self.is_gaussian:
            a, x_sq = self._center_terms(x, centers, gamma)
            return _gaussian_log_units(a, x_sq, gamma, inplace=False)
        a, x_sq = self._center_terms(x, centers, torch.ones_like(gamma))
        return self._from_sq_dist((x_sq - a).clamp_min(0.), gamma)

    def kernel_to_centers(self, x: torch.Tensor, centers: torch.Tensor) -> torch.Tensor:
        """``K(x, t_i)`` against ``M`` centres with one width each: ``(..., D), (M, D) -> (..., M)``."""
        if not self.is_gaussian:
            return self.log_kernel_to_centers(x, centers).exp()
        gamma = self.gamma()
        a, x_sq = self._center_terms(x, centers, gamma)
        return gaussian_units(a, x_sq, gamma)

    def dot_product_operands(
            self,
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
            gamma: torch.Tensor,
            pad_to: int = 0,
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gaussian attention as plain scaled-dot-product attention, for fused kernels.

        Along a softmax over keys ``j`` the query norm is a constant, so

            softmax_j(-gamma ||q_i - k_j||^2) = softmax_j([q_i, 1] . [2 gamma k_j, -gamma ||k_j||^2]).

        Takes projected ``q``, ``k`` and ``v`` of shape ``(..., N, D)`` and ``gamma`` broadcastable to
        ``(..., 1, 1)``; returns ``(q', k', v')`` zero-padded to a common width that is a multiple of ``pad_to``
        (by default 8 on CUDA, what its flash kernels accept; no more than the one extra channel elsewhere), in
        ``q``'s dtype. Attend with ``scale=1`` and keep the first ``D`` channels.
        """
        if not self.is_gaussian:
            raise RuntimeError('Only the Gaussian kernel has a dot-product form; use log_kernel for the Laplacian.')
        dtype = q.dtype
        q, k, v = augment_qkv(q, k.to(dtype), v.to(dtype), gamma.to(dtype), pad_to).unbind(0)
        return q, k, v

    def distance_query(self, q: torch.Tensor) -> torch.Tensor:
        """``q -> gamma [2 q, -1]`` for ``q`` of shape ``(num_widths, D)`` (Gaussian kernel, no metric): against keys
        stored as :func:`distance_key` gives

            [2 gamma q, -gamma] . [k, ||k||^2] = -gamma ||q - k||^2 + gamma ||q||^2,

        whose last term is the same for every key and cancels in a softmax over keys: Gaussian logits as one dot
        product, with widths on the query side so that keys can be stored once for queries of any width."""
        if not self.is_gaussian or self.metric is not None:
            raise RuntimeError('distance_query needs the Gaussian kernel without a Mahalanobis metric.')
        gamma = self.gamma().unsqueeze(-1)
        return torch.cat([2. * gamma * q, -gamma], dim=-1)

    def extra_repr(self) -> str:
        return f'dim={self.dim}, num_widths={self.log_gamma.numel()}, kernel={self.kernel}, ' \
               f'mahalanobis={self.metric is not None}'
