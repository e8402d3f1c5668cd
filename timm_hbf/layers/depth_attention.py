"""Attention over depth: a sublayer's read of, and write to, a per-token memory of earlier outputs (QIMIA, Dugue 2023,
report Eq. 1, which it repeats as Eq. 2; Attention Residuals, Kimi Team 2026).

Every sublayer ``l`` owns a learned query ``q_l`` and reads, per token and per head ``h``, the entries ``(k_i, v_i)``
that the embedding and the earlier sublayers wrote for that token:

    A_l = sum_i w_i v_{i,h},   w_i = softmax_i(s_i)                                             (Eq. 1)
    s_i = q_{l,h} . k_{i,h}                              dot-product kernel (Eq. 1)
    s_i = -gamma_h ||q_{l,h} - k_{i,h}||^2               Gaussian kernel, the report's L2 attention

Heads split the key and the value channels into contiguous groups. Zero queries (the init) give the dot-product
kernel equal logits: every read starts as the uniform average of its entries.

The memory is two lists, keys ``(B, N, .)`` and values ``(B, N, D)``; an entry shared by the batch (the position
embedding, the null entry) may be ``(1, N, .)`` or ``(.,)``. Keys are stored as reads use them
(:meth:`DepthAttention.key`): unit L2 per head (``'l2'``, the report's key normalisation) or RMS-normalised per head
(``'rms'``, AttnRes's keys, the values normalised), then, for the Gaussian kernel, with ``||k_h||^2`` appended per
head, so that ``s_i = gamma_h (2 q_h . k_{i,h} - ||k_{i,h}||^2)``: the Gaussian logit up to ``-gamma_h ||q_h||^2``,
which the softmax cancels. Reads go entry by entry, element-wise, in float32 or wider whatever the entries' dtype,
in plain autograd (its peak memory for vit_qimia_tiny is 9 to 13 % above that of a hand-written backward pass that
recomputed the weights, which was no faster, and 5 % slower compiled: docs/qimia.md).
"""
import math
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.jit import Final

from .._checks import check_choice, check_count, check_divisor, check_rate
from .hyperbf_kernel import HyperBFKernel, accumulation_dtype

__all__ = ['DEPTH_KERNELS', 'DepthAttention', 'depth_logits', 'normalized_entropy']

DEPTH_KERNELS = ('dot', 'gaussian')
KEY_NORMS = ('', 'l2', 'rms')


def depth_logits(query: torch.Tensor, key: torch.Tensor, gamma: Optional[torch.Tensor]) -> torch.Tensor:
    """``s_i`` of one entry for every head: ``query (H, Dk)``, ``key (..., H * Dk)`` as stored (``H * (Dk + 1)`` with
    ``||k_h||^2`` for the Gaussian kernel), ``gamma (H,)`` for the Gaussian kernel or None -> ``(..., H)``, in the
    query's dtype."""
    k = key.unflatten(-1, (query.shape[0], -1)).to(query.dtype)
    if gamma is None:
        return (k * query).sum(-1)
    return gamma * (2. * (k[..., :-1] * query).sum(-1) - k[..., -1])


def _broadcast(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    """``torch.broadcast_tensors``, which TorchScript takes as a list and eager mode as arguments."""
    if torch.jit.is_scripting():
        return torch.broadcast_tensors(tensors)
    return torch.broadcast_tensors(*tensors)


class DepthAttention(nn.Module):
    """A sublayer's interface to the depth memory: its read (Eq. 1-2, :meth:`forward`), and how entries are stored
    (:meth:`key`) and written (:meth:`write`).

    Args:
        key_dim: Key width (the query's), before the Gaussian kernel's extra channel per head.
        num_heads: Heads; they split the key and the value channels.
        kernel: ``'dot'`` (the report's default) or ``'gaussian'`` (the HyperBF kernel's widths, one per head,
            starting at 1/2 so that ``-gamma ||q - k||^2`` keeps the ``q . k`` term of the dot product). Zero queries
            then give ``softmax_i(-gamma_h ||k_{i,h}||^2)``, uniform only where the keys of a head have equal norms.
        key_norm: ``''``, ``'l2'`` or ``'rms'``: the normalisation of stored keys, per head.
        path_drop: Dropout on the attention weights in training (the report's path dropout).
    """
    num_heads: Final[int]
    key_norm: Final[str]
    path_drop: Final[float]

    def __init__(
            self,
            key_dim: int,
            num_heads: int,
            kernel: str = 'dot',
            key_norm: str = '',
            path_drop: float = 0.,
            device: torch.types.Device = None,
            dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        check_count('key_dim', key_dim)
        check_count('num_heads', num_heads)
        check_divisor('num_heads', num_heads, 'key_dim', key_dim)
        check_choice('kernel', kernel, DEPTH_KERNELS)
        check_choice('key_norm', key_norm, KEY_NORMS)
        check_rate('path_drop', path_drop)
        dd = {'device': device, 'dtype': dtype}
        self.num_heads = num_heads
        self.key_norm = key_norm
        self.path_drop = path_drop
        self.query = nn.Parameter(torch.zeros(num_heads, key_dim // num_heads, **dd))
        self.kernel = HyperBFKernel(key_dim // num_heads, num_heads, gamma_init=.5, **dd) \
            if kernel == 'gaussian' else None

    def init_weights(self) -> None:
        nn.init.zeros_(self.query)

    def gamma(self) -> Optional[torch.Tensor]:
        """The Gaussian kernel's widths ``(H,)``, None for the dot product."""
        if self.kernel is None:
            return None
        return self.kernel.gamma()

    def key(self, key: torch.Tensor) -> torch.Tensor:
        """A key ``(..., H * Dk)`` as the memory stores it: normalised per head, then ``[k_h, ||k_h||^2]`` per head
        for the Gaussian kernel."""
        k = key.unflatten(-1, (self.num_heads, -1))
        if self.key_norm == 'l2':
            k = F.normalize(k, dim=-1)
        elif self.key_norm == 'rms':
            k = F.rms_norm(k, [k.shape[-1]], eps=1e-6)
        if self.kernel is not None:
            k = torch.cat([k, k.pow(2).sum(-1, keepdim=True)], dim=-1)
        return k.flatten(-2)

    def weights(self, keys: List[torch.Tensor]) -> torch.Tensor:
        """``w_i`` (Eq. 1's softmax), ``(B, N, H, len(keys))``, in float32 or wider. Entries go last: with them first,
        inductor fused the softmax with the read's sum and the LayerNorm after it into a GPU kernel 6.6x slower
        (docs/gpu.md)."""
        query, gamma = self.query.to(accumulation_dtype(self.query)), self.gamma()
        return torch.stack(_broadcast([depth_logits(query, k, gamma) for k in keys]), -1).softmax(-1)

    def forward(self, keys: List[torch.Tensor], values: List[torch.Tensor]) -> torch.Tensor:
        """``A = sum_i w_i v_i`` (Eq. 1), ``(B, N, D)`` in the query's dtype, summed entry by entry in float32 or
        wider."""
        weights = self.weights(keys)
        if self.training and self.path_drop > 0.:
            weights = F.dropout(weights, self.path_drop)
        w = weights.unsqueeze(-1).unbind(-2)  # (whose backward stacks the gradients once; w[i] would fill L zeros)
        out = w[0] * values[0].unflatten(-1, (self.num_heads, -1))
        for i in range(1, len(values)):
            out = out.addcmul_(w[i], values[i].unflatten(-1, (self.num_heads, -1)))
        return out.flatten(-2).to(self.query.dtype)

    def write(
            self,
            keys: List[torch.Tensor],
            values: List[torch.Tensor],
            key: Optional[torch.Tensor],
            value: torch.Tensor,
            position: int,
    ) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """The memory with an entry written: appended at ``position`` 0, or, past the first place of a memory block
        (Block AttnRes), merged into the block's summary (the last entry): values summed, a residual stream within
        the block, in float32 or wider; learned keys averaged, so that a summary's logit is its members' mean
        logit. ``key`` None: the key is the value, normalised (AttnRes), the summary's recomputed from the sum. The
        lists passed in are left as they are."""
        if key is not None:
            key = self.key(key)
        if position > 0:
            dtype = accumulation_dtype(value)
            value = values[-1].to(dtype) + value
            if key is not None:
                key = torch.lerp(keys[-1].to(dtype), key.to(dtype), 1. / (position + 1))
            keys, values = keys[:-1], values[:-1]
        if key is None:
            key = self.key(value)
        return keys + [key], values + [value]

    def extra_repr(self) -> str:
        return f'num_heads={self.num_heads}, key_norm={self.key_norm!r}, path_drop={self.path_drop}'


def normalized_entropy(weights: torch.Tensor) -> torch.Tensor:
    """Entropy of attention weights over entries (the last dim), divided by ``log(L)``: 1 for a uniform average (what
    a residual stream computes), 0 for a single entry. The report's entropy metric, averaged over all other dims."""
    entropy = -(weights * weights.clamp_min(1e-30).log()).sum(-1).mean()
    num = weights.shape[-1]
    return entropy / math.log(num) if num > 1 else torch.zeros_like(entropy)
