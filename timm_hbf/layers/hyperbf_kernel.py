"""The HyperBF kernel shared by every HyperBF layer (CBMM Memo 143, Eq. 4).

    K(x, t) = exp(-gamma * ||W (x - t)||^2)        Gaussian (default); gamma = 1 / (2 sigma^2)
    K(x, t) = exp(-gamma * ||W (x - t)||)          Laplacian (memo, footnote 1)

``gamma`` is learned through its logarithm, so it stays positive whatever the optimizer does. ``W`` is the optional
Mahalanobis factor: the metric ``W^T W`` is positive semi-definite by construction and starts at the identity, where
the kernel is the plain radial basis function.

Distances are never formed from ``x[:, None] - t[None]`` differences: ``||x - t||^2 = ||x||^2 + ||t||^2 - 2 x.t``
turns them into one matrix product of operands augmented with their norms, which is what lets HyperBF layers cost
what their dot-product counterparts cost. The hot paths (points augmented for their distances to centres, Gaussian
units, Gaussian attention) have hand-written backward passes that keep only what the next op saves anyway: the MLP
keeps less activation memory than a GELU MLP, the attention about what plain scaled-dot-product attention keeps (its
weights too, where CPU training writes them out: :func:`explicit_weights_pay`).
"""
import math
from typing import Tuple

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.jit import Final

__all__ = [
    'HyperBFKernel', 'KERNELS', 'augment_points', 'distance_key', 'explicit_weights_pay', 'gaussian_sdpa',
    'pairwise_sq_dist',
]

KERNELS = ('gaussian', 'laplacian')
LOG_GAMMA_BOUND = 60.  # exp(+-60) is finite and non-zero in fp32 and bf16
LOG2_E, LN_2 = math.log2(math.e), math.log(2.)


def pairwise_sq_dist(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``||x_i - t_j||^2`` for all pairs as one matrix product: ``(..., N, D), (..., M, D) -> (..., N, M)``."""
    x_sq = x.pow(2).sum(-1, keepdim=True)
    t_sq = t.pow(2).sum(-1).unsqueeze(-2)
    return (x_sq + t_sq - 2. * (x @ t.transpose(-1, -2))).clamp_min(0.)


# --- Gaussian units against centres: 2^min(log2 K, 0) on a fresh matrix product -------------------------------------

def _gaussian_units(log2_k: torch.Tensor, inplace: bool) -> torch.Tensor:
    """``2^min(log2_k, 0)``, overwriting ``log2_k`` if ``inplace``; the cap only removes rounding error (a distance
    cannot be negative). Base 2 because torch's CPU ``exp2`` runs several times faster than its ``exp``; the
    factor ``log2(e)`` rides on the widths, inside the matrix product that makes ``log2_k``."""
    return log2_k.clamp_max_(0.).exp2_() if inplace else log2_k.clamp_max(0.).exp2()


class _GaussianUnits(torch.autograd.Function):
    """:func:`_gaussian_units` in place on ``log2_k`` (a fresh matrix product), saving only its output; the gradient,
    ``ln 2 * 2^log2_k``, passes the cap as if it were not there."""

    @staticmethod
    def forward(ctx, log2_k: torch.Tensor) -> torch.Tensor:
        out = _gaussian_units(log2_k, inplace=True)
        ctx.mark_dirty(log2_k)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        out, = ctx.saved_tensors
        return torch.addcmul(grad.new_zeros(()), grad, out, value=LN_2)  # one pass, no temporary


def gaussian_units(log2_k: torch.Tensor) -> torch.Tensor:
    """``2^min(log2_k, 0)``; overwrites ``log2_k``, which must not be a view (autograd would copy it back)."""
    if torch.jit.is_scripting() or not torch.is_grad_enabled():
        return _gaussian_units(log2_k, inplace=not torch.is_grad_enabled())
    return _GaussianUnits.apply(log2_k)


# --- Points augmented with their squared norm, for distances to centres as one matrix product -------------------------

def _augment_points(x: torch.Tensor, pad: int) -> torch.Tensor:
    """``(P, D) -> (P, D + 2 + pad)``: ``[x, ||x||^2, 1, 0...]``, written into one fresh buffer."""
    dim = x.shape[-1]
    x_aug = x.new_empty(x.shape[0], dim + 2 + pad)
    x_aug[:, :dim] = x
    x_aug[:, dim] = x.pow(2).sum(-1)
    x_aug[:, dim + 1] = 1.
    x_aug[:, dim + 2:] = 0.
    return x_aug


class _AugmentPoints(torch.autograd.Function):
    """:func:`_augment_points` that saves only its output (which the matrix product after it saves anyway) and
    returns the gradient ``g_x + 2 x g_norm`` in one pass."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, pad: int) -> torch.Tensor:
        x_aug = _augment_points(x, pad)
        ctx.save_for_backward(x_aug)
        ctx.dim = x.shape[-1]
        return x_aug

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x_aug, = ctx.saved_tensors
        dim = ctx.dim
        return torch.addcmul(grad[:, :dim], x_aug[:, :dim], grad[:, dim:dim + 1], value=2.), None


def augment_points(x: torch.Tensor, pad: int = 0) -> torch.Tensor:
    """``[x, ||x||^2, 1]`` for points ``(P, D)``, zero-padded by ``pad`` channels: against ``[2 gamma t, -gamma,
    -gamma ||t||^2, 0...]`` a dot product gives ``-gamma ||x - t||^2``."""
    if torch.jit.is_scripting() or not torch.is_grad_enabled():
        return _augment_points(x, pad)
    return _AugmentPoints.apply(x, pad)


# --- Gaussian attention as a dot product ------------------------------------------------------------------------------

def _augment_qkv(
        qkv: torch.Tensor,
        gamma: torch.Tensor,
        pad: int,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(B, N, 3, H, D) -> 3 x (B, H, N, D + pad)``: ``[q, 1...]``, ``[2 gamma k, -gamma ||k||^2, 0...]`` and
    ``[v, 0...]``, each contiguous as the attention kernels prefer, in one pass over the qkv projection."""
    dim = qkv.shape[-1]
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    q_aug, k_aug, v_aug = (qkv.new_empty(q.shape[:-1] + (dim + pad,)) for _ in range(3))
    q_aug[..., :dim] = q
    q_aug[..., dim:] = 1.  # every pad channel of q is 1: only the first meets a non-zero key channel
    if torch.is_grad_enabled():  # scripted models; autograd does not differentiate through out=
        k_aug[..., :dim] = k * (2. * gamma)
    else:
        torch.mul(k, 2. * gamma, out=k_aug[..., :dim])
    k_aug[..., dim:dim + 1] = -gamma * k.pow(2).sum(-1, keepdim=True)
    k_aug[..., dim + 1:] = 0.
    v_aug[..., :dim] = v
    v_aug[..., dim:] = 0.
    return q_aug, k_aug, v_aug


class _AugmentQKV(torch.autograd.Function):
    """:func:`_augment_qkv` that saves only the augmented keys (which the attention kernel saves anyway) and gamma,
    and writes the gradient of the qkv projection in one pass, in the projection's layout."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, gamma: torch.Tensor, pad: int):
        q_aug, k_aug, v_aug = _augment_qkv(qkv, gamma, pad)
        ctx.save_for_backward(k_aug, gamma)
        ctx.dim = qkv.shape[-1]
        return q_aug, k_aug, v_aug

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_q_aug: torch.Tensor, grad_k_aug: torch.Tensor, grad_v_aug: torch.Tensor):
        k_aug, gamma = ctx.saved_tensors
        dim = ctx.dim
        k_main, k_norm = k_aug[..., :dim], k_aug[..., dim:dim + 1]  # 2 gamma k, -gamma ||k||^2
        grad_main, grad_norm = grad_k_aug[..., :dim], grad_k_aug[..., dim:dim + 1]
        # d/dgamma of (2 gamma k . g_main - gamma ||k||^2 g_norm), summed to gamma's shape
        grad_gamma = ((k_main * grad_main).sum(-1, keepdim=True) + k_norm * grad_norm) / gamma
        B, H, N = k_aug.shape[:3]
        grad_qkv = k_aug.new_empty(B, N, 3, H, dim)
        grad_q, grad_k, grad_v = grad_qkv.permute(2, 0, 3, 1, 4).unbind(0)
        grad_q.copy_(grad_q_aug[..., :dim])
        torch.mul(grad_main, 2. * gamma, out=grad_k)  # 2 gamma (g_main - k g_norm)
        grad_k.addcmul_(k_main, grad_norm, value=-1.)
        grad_v.copy_(grad_v_aug[..., :dim])
        return grad_qkv, grad_gamma.sum_to_size(gamma.shape), None


def augment_qkv(qkv: torch.Tensor, gamma: torch.Tensor, pad_to: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_augment_qkv` to a width that is a multiple of ``pad_to`` (0: of 8 on CUDA, whose flash kernels need
    it, else any width), with a backward pass that keeps no more than the attention kernel keeps."""
    if pad_to <= 0:
        pad_to = 8 if qkv.is_cuda else 1
    pad = (-(qkv.shape[-1] + 1) % pad_to) + 1
    if torch.jit.is_scripting() or not torch.is_grad_enabled():
        return _augment_qkv(qkv, gamma, pad)
    return _AugmentQKV.apply(qkv, gamma, pad)


# --- Gaussian attention with written-out weights, head by head (CPU training on short sequences) ----------------------

def explicit_weights_pay(qkv: torch.Tensor) -> bool:
    """Whether :class:`_GaussianAttentionPerHead` serves ``qkv`` better than a fused kernel at the augmented width: on
    the CPU, up to ``4 x head_dim`` tokens (with heads of 64: the 65 tokens of the 32x32 models with patch 4 and the
    197 of the 224x224 models with patch 16). There the per-head matrix products ran faster than the fused kernel,
    whose CPU kernels lose a fifth of their speed past a head width of 64; at 321 tokens they ran slower. Per head
    and token the path keeps ``3 D + N`` values (q, k, v and a row of weights) where the fused path keeps about
    ``4 D`` (augmented q, k, v and its output): the same at ``N = D``, under twice as much at ``N = 4 D``. Longer
    sequences take the fused kernels, whose memory grows linearly with the length."""
    return qkv.device.type == 'cpu' and qkv.shape[1] <= 4 * qkv.shape[-1]


class _GaussianAttentionPerHead(torch.autograd.Function):
    """Gaussian attention ``(B, N, 3, H, D) -> (B, N, H, D)`` with each head's weights written out, read straight from
    the strided q, k, v of the qkv projection and written in the layout the output projection reads. Per head, the
    logits ``2 gamma (q . k - ||k||^2 / 2)`` are one ``baddbmm``; the backward pass is four matrix products,

        dV = P^T dO,    dS = P * (dO V^T - rowsum(P * dO V^T)),
        dQ = 2 gamma dS K,    dK = 2 gamma (dS^T Q - colsum(dS) K),
        dgamma = 2 sum(Q * dS K) - sum(colsum(dS) ||K||^2),

    and it keeps qkv and the weights ``P``. Runs in the dtype of ``qkv`` (autocast off inside)."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
        B, N, _, H, D = qkv.shape
        scale = (2. * gamma).reshape(-1).expand(H)
        out = qkv.new_empty(B, N, H, D)
        weights = []
        with torch.autocast(qkv.device.type, enabled=False):
            for h in range(H):
                q, k, v = qkv[:, :, :, h].unbind(2)
                half_key_norm = torch.linalg.vecdot(k, k).mul_(-.5).unsqueeze(1)  # (B, 1, N)
                logits = torch.baddbmm(half_key_norm, q, k.transpose(1, 2)).mul_(scale[h])
                weights.append(logits.softmax(-1))
                out[:, :, h] = torch.bmm(weights[-1], v)
        ctx.save_for_backward(qkv, gamma, *weights)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        qkv, gamma, *weights = ctx.saved_tensors
        H = qkv.shape[3]
        scale = (2. * gamma).reshape(-1).expand(H)
        grad_qkv = qkv.new_empty(qkv.shape)
        grad_gamma = qkv.new_empty(H)
        for h, p in enumerate(weights):
            q, k, v = qkv[:, :, :, h].unbind(2)
            grad_q, grad_k, grad_v = grad_qkv[:, :, :, h].unbind(2)
            g = grad_out[:, :, h]
            grad_v.copy_(torch.bmm(p.transpose(1, 2), g))
            ds = torch.bmm(g, v.transpose(1, 2))
            ds.sub_(torch.linalg.vecdot(p, ds).unsqueeze(-1)).mul_(p)  # through the softmax
            col = ds.sum(1)  # (B, N): the gradient of each key's norm term
            ds_k = torch.bmm(ds, k)
            torch.mul(ds_k, scale[h], out=grad_q)
            torch.mul(torch.bmm(ds.transpose(1, 2), q).addcmul_(k, col.unsqueeze(-1), value=-1.), scale[h], out=grad_k)
            grad_gamma[h] = 2. * torch.linalg.vecdot(q, ds_k).sum() - (col * torch.linalg.vecdot(k, k)).sum()
        return grad_qkv, grad_gamma.sum_to_size(gamma.numel()).view(gamma.shape)


def gaussian_sdpa(
        qkv: torch.Tensor,
        gamma: torch.Tensor,
        dropout_p: float = 0.,
        pad_to: int = 0,
        inplace: bool = False,
) -> torch.Tensor:
    """Gaussian attention without distance matrices: ``(B, N, 3, H, D) -> (B, H, N, D)``, with ``gamma`` of shape
    ``(H, 1, 1)`` or ``(1, 1, 1)`` (see :meth:`HyperBFKernel.dot_product_attention`). Three ways, by what is fastest:

    * CPU training of sequences up to ``4 x head_dim`` tokens (:func:`explicit_weights_pay`), without attention
      dropout: per-head matrix products with written-out weights (:class:`_GaussianAttentionPerHead`);
    * otherwise, where a gradient may be needed, or on CUDA (whose flash kernels take no mask): torch's fused
      kernels, with the key-norm term in an extra channel (:func:`augment_qkv`);
    * CPU inference: the fused kernel with the key-norm term as an additive mask, one row ``-gamma ||k_j||^2``
      broadcast over the queries, which torch's CPU flash kernel takes at no cost; it reads the projection's own
      q, k and v, and only the queries are scaled by ``2 gamma``, in place in ``qkv`` if ``inplace``.
    """
    needs_grad = torch.is_grad_enabled() and (qkv.requires_grad or gamma.requires_grad)
    if not torch.jit.is_scripting() and needs_grad and dropout_p == 0. and explicit_weights_pay(qkv):
        return _GaussianAttentionPerHead.apply(qkv, gamma).transpose(1, 2)
    if qkv.is_cuda or needs_grad:
        q, k, v = augment_qkv(qkv, gamma, pad_to)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=1.)[..., :qkv.shape[-1]]
    q_scale = 2. * gamma.reshape(-1, 1)  # (H or 1, 1) against the (B, N, H, D) queries
    queries = qkv[:, :, 0].mul_(q_scale) if inplace else qkv[:, :, 0] * q_scale
    keys = qkv[:, :, 1]
    # (B, H, 1, N), contiguous: with a transposed mask the CPU kernel ran about 30 % slower at 197 tokens
    key_bias = torch.linalg.vecdot(keys, keys).transpose(1, 2).contiguous().mul_(-gamma.reshape(-1, 1)).unsqueeze(-2)
    return F.scaled_dot_product_attention(queries.transpose(1, 2), keys.transpose(1, 2), qkv[:, :, 2].transpose(1, 2),
                                          attn_mask=key_bias, dropout_p=dropout_p, scale=1.)


def distance_key(k: torch.Tensor) -> torch.Tensor:
    """``k -> [k, ||k||^2]``: keys for :meth:`HyperBFKernel.distance_query`."""
    return torch.cat([k, k.pow(2).sum(-1, keepdim=True)], dim=-1)


# Leaves for torch.fx: traced graphs call the functions (and so their custom backward) instead of tracing through them.
torch.fx.wrap('augment_points')
torch.fx.wrap('gaussian_units')
torch.fx.wrap('gaussian_sdpa')


class HyperBFKernel(nn.Module):
    """Radial basis kernel with learned widths and an optional learned Mahalanobis metric.

    Evaluations that share the parameters:

    * :meth:`log_kernel`: the plain formula on a full distance matrix (reference path);
    * :meth:`log_kernel_to_centers` and :meth:`kernel_to_centers`: points against a fixed set of centres with one
      width per centre, as a single ``linear`` (the cost of an MLP's first layer);
    * :meth:`dot_product_attention`: Gaussian attention rewritten for fused scaled-dot-product kernels.

    Args:
        dim: Feature dimension of the points and centres.
        num_widths: Number of independent widths (one per head, per centre, or 1 for the whole layer).
        gamma_init: Initial gamma (every width).
        kernel: ``'gaussian'`` or ``'laplacian'``.
        mahalanobis: Learn ``W`` (``dim x dim``, identity at init); distances become ``||W (x - t)||``.
        eps: Added under the Laplacian's square root, whose gradient is infinite at zero distance.
    """
    log_gamma_bound: Final[float] = LOG_GAMMA_BOUND
    log2_e: Final[float] = LOG2_E

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

    def _log_kernel_matrix(self, x: torch.Tensor, centers: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
        """``-gamma_i ||x - t_i||^2`` for points ``(..., D)`` flattened to ``(P, D)``: ``(P, M)``, as one matrix
        product of operands augmented with the norms,

            [x, ||x||^2, 1] . [2 gamma_i t_i, -gamma_i, -gamma_i ||t_i||^2] = -gamma_i ||x - t_i||^2,

        zero-padded to a width that is a multiple of 8. The product is a fresh tensor (not a view of one), which
        :func:`gaussian_units` may overwrite, and its backward pass is the two products of a bias-free ``linear``
        plus one pass for the norm channel; the points themselves are kept only inside ``x_aug``.
        """
        x, centers = self.project(x), self.project(centers)
        pad = -(self.dim + 2) % 8
        x_aug = augment_points(x.reshape(-1, x.shape[-1]), pad)
        gamma = gamma.unsqueeze(-1)
        centers_aug = torch.cat([2. * gamma * centers, -gamma, -gamma * centers.pow(2).sum(-1, keepdim=True),
                                 centers.new_zeros(centers.shape[0], pad)], dim=-1)
        return F.linear(x_aug, centers_aug)

    def log_kernel_to_centers(self, x: torch.Tensor, centers: torch.Tensor) -> torch.Tensor:
        """``log K(x, t_i)`` against ``M`` centres with one width each: ``(..., D), (M, D) -> (..., M)``."""
        gamma = self.gamma()
        shape = x.shape[:-1] + (centers.shape[0],)
        if self.is_gaussian:
            return self._log_kernel_matrix(x, centers, gamma).clamp_max(0.).reshape(shape)
        neg_sq_dist = self._log_kernel_matrix(x, centers, torch.ones_like(gamma))
        return self._from_sq_dist(neg_sq_dist.neg().clamp_min(0.), gamma).reshape(shape)

    def kernel_to_centers(self, x: torch.Tensor, centers: torch.Tensor) -> torch.Tensor:
        """``K(x, t_i)`` against ``M`` centres with one width each: ``(..., D), (M, D) -> (..., M)``."""
        if not self.is_gaussian:
            return self.log_kernel_to_centers(x, centers).exp()
        log2_k = self._log_kernel_matrix(x, centers, self.gamma() * self.log2_e)
        return gaussian_units(log2_k).reshape(x.shape[:-1] + (centers.shape[0],))

    def dot_product_attention(
            self,
            qkv: torch.Tensor,
            gamma: torch.Tensor,
            dropout_p: float = 0.,
            pad_to: int = 0,
            inplace: bool = False,
    ) -> torch.Tensor:
        """Gaussian attention as scaled dot products, without distance matrices.

        Along a softmax over keys ``j`` the query norm is a constant, so

            softmax_j(-gamma ||q_i - k_j||^2) = softmax_j(2 gamma q_i . k_j - gamma ||k_j||^2),

        a dot product of ``[q_i, 1]`` and ``[2 gamma k_j, -gamma ||k_j||^2]`` on torch's fused kernels, or, without
        gradients on the CPU, of ``2 gamma q_i`` and ``k_j`` plus a mask; CPU training of short sequences multiplies
        per head instead (:func:`gaussian_sdpa`).

        Takes projected queries, keys and values stacked as a qkv projection makes them, ``(B, N, 3, H, D)``, and
        one width per head or one for all, ``gamma`` of shape ``(H,)`` or ``(1,)``; returns ``(B, H, N, D)``. In the
        extra channel, the operands are zero-padded to a common width that is a multiple of ``pad_to`` (by default 8
        on CUDA, what its flash kernels accept; no more than the one extra channel elsewhere). ``inplace`` lets the
        mask path scale the queries in ``qkv`` itself, as an in-place activation overwrites its input.
        """
        if not self.is_gaussian:
            raise RuntimeError('Only the Gaussian kernel has a dot-product form; use log_kernel for the Laplacian.')
        return gaussian_sdpa(qkv, gamma.to(qkv.dtype).reshape(-1, 1, 1), dropout_p, pad_to, inplace)

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
