"""Learned-query attention over depth (QIMIA, Dugue 2023, report Eq. 1-2).

Every block ``l`` owns a learned query and reads, per token and per head ``h``,

    A_l = Norm( sum_i w_{l,i,h} v_{i,h} ),  w_{l,i,h} = softmax_i(s_{l,i,h}),  s_{l,i,h} = q_{l,h} . k_{i,h}   (Eq. 1-2)

over the memory entries ``(k_i, v_i)`` that the embedding and the earlier blocks wrote for that token. Heads split
the key channels and the value channels into ``num_heads`` contiguous groups each. With the dot-product kernel, zero
queries (the init) give every entry the same logit: every read starts as the uniform average of the entries it sees.

The memory is two lists of tensors, keys ``(B, N, key_width)`` and values ``(B, N, dim)``; an entry shared by the
batch (the position embedding, a learned null entry) may be ``(1, N, width)`` or ``(width,)``. A read never stacks
the entries: it takes each entry's logits as per-head dot products and accumulates the values entry by entry, all
element-wise, so that ``torch.compile`` fuses a read into a few loops over the tokens (its backward pass adds one
reduction over the tokens, for the query's gradient).

In training a read is :class:`_DepthRead`, which keeps for its backward pass (all through ``save_for_backward``) the
query, the entries it read (tensors that the memory holds anyway) and, with the norm, its output and ``1 / std``; the
weights are recomputed from the keys. Plain autograd would also keep every read's weights ``(L, B, N, H)``, which
grow with the square of the depth, and the mix before the norm.
"""
import math
from typing import List, Optional, Tuple

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.jit import Final

from .hyperbf_kernel import HyperBFKernel

__all__ = ['DEPTH_KERNELS', 'DepthAttention', 'DepthKey', 'depth_attend', 'depth_weights', 'normalized_entropy']

DEPTH_KERNELS = ('dot', 'gaussian')


def accumulation_dtype(x: torch.Tensor) -> torch.dtype:
    """float32, or float64 for float64 ``x``: the dtype of a read's logits, weights and sum of values (``x`` the
    query), whatever the entries' dtype (bf16 under autocast)."""
    return torch.promote_types(x.dtype, torch.float32)


def _entry_logits(key: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """``q_h . k_h`` for one entry: ``(..., H * Dk), (H, Dk) -> (..., H)`` in the query's dtype."""
    return (key.unflatten(-1, query.shape).to(query.dtype) * query).sum(-1)


def _logits(query: torch.Tensor, key_entries: List[torch.Tensor]) -> torch.Tensor:
    """Logits of every entry, ``(L, B, N, H)``, in the accumulation dtype (entries shared by the batch broadcast)."""
    query = query.to(accumulation_dtype(query))
    logits = [_entry_logits(k, query) for k in key_entries]
    full = logits[0]
    for s in logits:  # the logits of a batch entry: the shape the others broadcast to
        if s.dim() > full.dim() or s.numel() > full.numel():
            full = s
    return torch.stack([s.expand_as(full) for s in logits])


def _drop(weights: torch.Tensor, drop: float) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Dropout on the weights (path dropout): the dropped weights and the mask of kept ones (None for no dropout)."""
    if drop <= 0.:
        return weights, None
    keep = torch.rand_like(weights) >= drop
    return weights * keep / (1. - drop), keep


def _mix(weights: torch.Tensor, value_entries: List[torch.Tensor]) -> torch.Tensor:
    """``sum_i w_{i,h} v_{i,h}``: ``(L, B, N, H)`` weights and ``L`` values ``(B, N, D)`` (or broadcast to it) ``->
    (B, N, D)`` in the weights' dtype, accumulated entry by entry (no ``(L, B, N, D)`` temporary)."""
    heads = weights.shape[-1]
    w = weights.unsqueeze(-1)
    out = w[0] * value_entries[0].unflatten(-1, (heads, -1))
    for i in range(1, len(value_entries)):
        out.addcmul_(w[i], value_entries[i].unflatten(-1, (heads, -1)))
    return out.flatten(-2)


def _read(
        query: torch.Tensor,
        key_entries: List[torch.Tensor],
        value_entries: List[torch.Tensor],
        drop: float,
        norm_eps: float,
) -> torch.Tensor:
    """A read in plain autograd (inference, TorchScript, and the reference of :class:`_DepthRead`)."""
    weights, _ = _drop(_logits(query, key_entries).softmax(0), drop)
    out = _mix(weights, value_entries)
    if norm_eps > 0.:
        out = F.layer_norm(out, [out.shape[-1]], eps=norm_eps)
    return out.to(query.dtype)


class _DepthRead(torch.autograd.Function):
    """:func:`_read` that keeps neither its weights nor the mix before the norm (see the module docstring): the
    backward pass recomputes the weights from the keys, and the norm's backward works from the output (which the
    next layer keeps anyway) and ``1 / std``. Entries come as ``L`` keys, then ``L`` values."""

    @staticmethod
    def forward(ctx, query, drop: float, norm_eps: float, *entries):
        num = len(entries) // 2
        weights, keep = _drop(_logits(query, list(entries[:num])).softmax(0), drop)
        out = _mix(weights, list(entries[num:]))
        rstd = None
        if norm_eps > 0.:
            out, _, rstd = torch.native_layer_norm(out, [out.shape[-1]], None, None, norm_eps)
        ctx.drop = drop
        ctx.save_for_backward(query, keep, out if rstd is not None else None, rstd, *entries)
        return out.to(query.dtype)

    @staticmethod
    def backward(ctx, grad):
        query, keep, normed, rstd, *entries = ctx.saved_tensors
        num = len(entries) // 2
        key_entries, value_entries = entries[:num], entries[num:]
        weights = _logits(query, key_entries).softmax(0)  # (L, B, N, H)
        heads, dtype = weights.shape[-1], weights.dtype
        grad = grad.to(dtype)
        if rstd is not None:  # LayerNorm backward from y and 1 / std: rstd (g - mean(g) - y mean(g y))
            grad = rstd * (grad - grad.mean(-1, keepdim=True) - normed * (grad * normed).mean(-1, keepdim=True))
        grad = grad.unflatten(-1, (heads, -1))  # (B, N, H, Dv)
        used = weights if keep is None else weights * keep / (1. - ctx.drop)
        grad_values = []
        grad_used = torch.empty_like(weights)
        for i in range(num):
            value = value_entries[i]
            grad_values.append((used[i].unsqueeze(-1) * grad).flatten(-2).sum_to_size(value.shape).to(value.dtype))
            grad_used[i] = (value.unflatten(-1, (heads, -1)).to(dtype) * grad).sum(-1)
        grad_weights = grad_used if keep is None else grad_used * keep / (1. - ctx.drop)
        grad_logits = weights * (grad_weights - (weights * grad_weights).sum(0, keepdim=True))  # softmax backward
        query_c = query.to(dtype)
        grad_keys = []
        for i in range(num):
            key = key_entries[i]
            grad_s = grad_logits[i].sum_to_size(key.shape[:-1] + (heads,))
            grad_keys.append((grad_s.unsqueeze(-1) * query_c).flatten(-2).to(key.dtype))
        # the query's gradient sum_tokens sum_i ds_i k_i: the keys mixed with the logits' gradients as a read mixes
        # values (entry by entry, element-wise), then one reduction over the tokens (not one per entry)
        moment = _mix(grad_logits, key_entries).unflatten(-1, query_c.shape)
        grad_query = moment.sum_to_size(query_c.shape).to(query.dtype)
        return (grad_query, None, None, *grad_keys, *grad_values)


def depth_attend(
        query: torch.Tensor,
        key_entries: List[torch.Tensor],
        value_entries: List[torch.Tensor],
        drop: float = 0.,
        norm_eps: float = 0.,
) -> torch.Tensor:
    """Attention of ``query (H, Dk)`` over the memory entries ``key_entries[i] (B, N, H * Dk)``, ``value_entries[i]
    (B, N, D)`` (Eq. 1-2): ``(B, N, D)`` in the query's dtype. ``drop``: dropout on the weights; ``norm_eps > 0``
    applies LayerNorm without affine, with that epsilon, to the result."""
    if torch.jit.is_scripting() or not torch.is_grad_enabled():
        return _read(query, key_entries, value_entries, drop, norm_eps)
    return _DepthRead.apply(query, drop, norm_eps, *key_entries, *value_entries)


def depth_weights(query: torch.Tensor, key_entries: List[torch.Tensor]) -> torch.Tensor:
    """The weights ``w_{i,h}`` of a read over the entries, ``(L, B, N, H)``, in float32 or wider."""
    return _logits(query, key_entries).softmax(0)


# A leaf for torch.fx, so that traced models keep the read's backward pass
torch.fx.wrap('depth_attend')


def normalized_entropy(weights: torch.Tensor) -> torch.Tensor:
    """Entropy of attention weights over entries (dim 0), divided by ``log(L)``: 1 for a uniform average (what a
    residual stream computes), 0 for a single entry. The report's entropy metric, averaged over all other dims."""
    entropy = -(weights * weights.clamp_min(1e-30).log()).sum(0).mean()
    num = weights.shape[0]
    return entropy / math.log(num) if num > 1 else torch.zeros_like(entropy)


def distance_key(k: torch.Tensor) -> torch.Tensor:
    """``k -> [k, ||k||^2]`` over the last dim: a key for Gaussian reads, against the operand of
    :meth:`DepthAttention.operand`."""
    return torch.cat([k, k.pow(2).sum(-1, keepdim=True)], dim=-1)


class DepthKey(nn.Module):
    """Puts a block's key ``(..., key_dim)`` into the form the memory stores: optionally unit L2 per head (the
    report's key normalisation), and ``[k_h, ||k_h||^2]`` per head for Gaussian depth attention."""
    normalize: Final[bool]
    gaussian: Final[bool]

    def __init__(self, key_dim: int, num_heads: int, normalize: bool = False, kernel: str = 'dot') -> None:
        super().__init__()
        self.num_heads = num_heads
        self.normalize = normalize
        self.gaussian = kernel == 'gaussian'
        self.width = key_dim + (num_heads if self.gaussian else 0)

    def forward(self, k: torch.Tensor) -> torch.Tensor:
        k = k.unflatten(-1, (self.num_heads, -1))
        if self.normalize:
            k = F.normalize(k, dim=-1)
        if self.gaussian:
            k = distance_key(k)
        return k.flatten(-2)


class DepthAttention(nn.Module):
    """One block's read of the depth memory (Eq. 1-2): a zero-initialised query per head, attention over the
    entries, then LayerNorm without affine (report appendix) or no norm.

    Args:
        dim: Value width (the token width).
        key_dim: Key width, before :class:`DepthKey`.
        num_heads: Heads; they split the key and the value channels.
        kernel: ``'dot'`` (softmax of ``q . k``, the report's default) or ``'gaussian'`` (softmax of
            ``-gamma_h ||q - k||^2``, the report's L2 attention, with the HyperBF kernel's widths, one per head).
            Zero queries then give ``softmax_i(-gamma_h ||k_{i,h}||^2)``, which favours short keys: uniform only
            where the keys of a head have equal norms, as with ``key_norm``.
        norm: LayerNorm (without affine) on the result.
        path_drop: Dropout on the attention weights in training (the report's path dropout).
    """

    def __init__(
            self,
            dim: int,
            key_dim: int,
            num_heads: int,
            kernel: str = 'dot',
            norm: bool = True,
            path_drop: float = 0.,
            device=None,
            dtype=None,
    ) -> None:
        super().__init__()
        if kernel not in DEPTH_KERNELS:
            raise ValueError(f"Unknown depth-attention kernel '{kernel}': use one of {DEPTH_KERNELS}.")
        if dim % num_heads or key_dim % num_heads:
            raise ValueError(
                f'dim ({dim}) and key_dim ({key_dim}) must both be divisible by the {num_heads} depth-attention '
                f'heads; choose depth_num_heads among their common divisors.')
        dd = {'device': device, 'dtype': dtype}
        self.num_heads = num_heads
        self.path_drop = path_drop
        self.query = nn.Parameter(torch.zeros(num_heads, key_dim // num_heads, **dd))
        # gamma = 1/2: -gamma ||q - k||^2 keeps the q . k term of the dot-product kernel
        self.kernel = HyperBFKernel(key_dim // num_heads, num_heads, gamma_init=.5, **dd) \
            if kernel == 'gaussian' else None
        self.norm_eps = 1e-6 if norm else 0.

    def init_weights(self) -> None:
        nn.init.zeros_(self.query)

    def operand(self) -> torch.Tensor:
        """The query as a dot-product operand against stored keys, ``(H, key width per head)``."""
        if self.kernel is None:
            return self.query
        # [2 gamma q, -gamma] . [k, ||k||^2] = -gamma ||q - k||^2 + gamma ||q||^2, the last term the same for all keys
        gamma = self.kernel.gamma().unsqueeze(-1)
        return torch.cat([2. * gamma * self.query, -gamma], dim=-1)

    def weights(self, key_entries: List[torch.Tensor]) -> torch.Tensor:
        """Attention weights ``(len(key_entries), B, N, H)`` over the entries, in float32 or wider."""
        return depth_weights(self.operand(), key_entries)

    def forward(self, key_entries: List[torch.Tensor], value_entries: List[torch.Tensor]) -> torch.Tensor:
        drop = self.path_drop if self.training else 0.
        return depth_attend(self.operand(), key_entries, value_entries, drop, self.norm_eps)

    def extra_repr(self) -> str:
        return f'num_heads={self.num_heads}, norm_eps={self.norm_eps}, path_drop={self.path_drop}'
