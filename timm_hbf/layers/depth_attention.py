"""Attention over depth: a sublayer's read of, and write to, a per-token memory of earlier outputs (QIMIA, Dugue 2023,
report Eq. 1, repeated as Eq. 2; Attention Residuals, Kimi Team 2026).

Every reading sublayer ``l`` owns a learned query ``q_l`` and reads, per token and per head ``h``, the (key, value)
entries that the stem and the earlier sublayers wrote:

    A_l = sum_i w_{l,i} v_{i,h},   w_{l,i} = softmax_i(s_{l,i})                                 (Eq. 1)
    s_{l,i} = q_{l,h} . k_{i,h}                              dot-product kernel (Eq. 1)
    s_{l,i} = -gamma_{l,h} ||q_{l,h} - k_{i,h}||^2           Gaussian kernel, the report's L2 attention

Heads split the key and the value channels into contiguous groups. The queries do not depend on the input, so an
entry's logits for every later read are known once it is written (AttnRes's two-phase computation). The memory
(:class:`DepthMemory`) therefore holds, for each read still to come, the online-softmax sums of what it will read:

    m_l = max_i s_{l,i} (no gradient: the softmax does not depend on it)
    Z_l = sum_i exp(s_{l,i} - m_l),   S_l = sum_i exp(s_{l,i} - m_l) v_i,   A_l = S_l / Z_l

A write is one product (the entry's logits for all later reads) and three element-wise updates, a read one division:
a fixed number of operations whatever the depth, in plain autograd, keeping for the backward pass no more than the
entries themselves. Logits and sums are float32 (or wider) whatever the entries' dtype, also under autocast.

Keys are stored as reads use them: unit L2 per head (``'l2'``, the report's key normalisation) or RMS-normalised per
head (``'rms'``, AttnRes's keys, the values normalised); for the Gaussian kernel with ``||k_h||^2`` appended per head,
and queries as ``[2 gamma_h q_h, -gamma_h]``, so that one product gives ``gamma_h (2 q_h . k_h - ||k_h||^2)``, the
Gaussian logit up to ``-gamma_h ||q_h||^2``, which the softmax cancels.

Block memory (Block AttnRes): the entries of ``n`` consecutive sublayers add up into one summary (values summed, a
residual stream within the block; learned keys averaged, so that its logit is its members' mean logit; AttnRes's keys
recomputed from the sum). A summary enters the sums when its block ends; a read inside a block merges the running
summary into its own sums (the intra-block phase).
"""
import math
from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.jit import Final

from .._checks import check_choice, check_count, check_divisor, check_rate
from .hyperbf_kernel import HyperBFKernel, accumulation_dtype

__all__ = ['DEPTH_KERNELS', 'DepthAttention', 'DepthMemory', 'depth_logits', 'depth_weights',
           'normalized_entropy']

DEPTH_KERNELS = ('dot', 'gaussian')
KEY_NORMS = ('', 'l2', 'rms')


class DepthMemory(NamedTuple):
    """The state of attention over depth between sublayers. ``R`` reads are still to come, the next one first; ``...``
    is ``(B, N)``, or 1s where every entry so far is shared by the batch."""
    queries: torch.Tensor  # (H, Dk', R) the reads' queries as :meth:`DepthAttention.memory_query` gives them
    keep: Optional[torch.Tensor]  # (R,) each read's path-dropout keep probability, None without path dropout
    max: torch.Tensor  # (..., H, R) m_l, no gradient
    norm: torch.Tensor  # (..., H, R) Z_l
    acc: torch.Tensor  # (..., H, R, Dv) S_l
    key: torch.Tensor  # (..., H * Dk') the newest entry's stored key, in block memory the running summary's
    value: torch.Tensor  # (..., D) its value


def _depth_logits(key: torch.Tensor, queries: torch.Tensor, rms: bool) -> torch.Tensor:
    dtype = accumulation_dtype(queries)
    k = key.to(dtype).unflatten(-1, (queries.shape[0], -1))
    if queries.shape[0] == 1:  # one head: a plain product
        logits = k @ queries[0].to(dtype)
    else:
        logits = torch.einsum('...hd,hdr->...hr', k, queries.to(dtype))
    if rms:  # RMS-normalised keys (the values): the norm applied to the product, no normalised copy kept
        rstd = k.pow(2).mean(-1, keepdim=True).add_(1e-6).rsqrt()
        logits = logits * rstd
    return logits


def depth_logits(key: torch.Tensor, queries: torch.Tensor, rms: bool = False) -> torch.Tensor:
    """``s_{l,i}`` of one entry for every read: stored ``key (..., H * Dk')``, ``queries (H, Dk', R)`` ->
    ``(..., H, R)``, in float32 (or wider), also under autocast. ``rms``: the key RMS-normalised per head first."""
    if not torch.jit.is_scripting() and key.device.type != 'meta':
        with torch.autocast(key.device.type, enabled=False):
            return _depth_logits(key, queries, rms)
    return _depth_logits(key, queries, rms)


torch.fx.wrap('depth_logits')  # a leaf for torch.fx: it cannot take the autocast device from a traced tensor


def _accumulate(
        state: Tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        logits: torch.Tensor,
        value: torch.Tensor,
        keep: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(m, Z, S)`` with one more entry of logits ``(..., H, R)`` and value ``(..., H, 1, Dv)``. Path dropout
    (``keep``) drops the entry from ``S`` only, as dropout on the softmax weights would."""
    old_max, norm, acc = state
    new_max = torch.maximum(old_max, logits.detach())
    rescale = (old_max - new_max).exp()
    weight = (logits - new_max).exp()
    norm = torch.addcmul(weight, norm, rescale)
    if keep is not None:
        weight = weight * torch.bernoulli(keep.expand(weight.shape)) / keep
    return new_max, norm, torch.addcmul(acc * rescale.unsqueeze(-1), weight.unsqueeze(-1), value)


class DepthAttention(nn.Module):
    """A sublayer's interface to the depth memory: its read (Eq. 1-2, :meth:`forward`) and its write
    (:meth:`write`). A sublayer that would read a single entry takes it as it is, and has no query.

    Args:
        key_dim: Key width (the query's), before the Gaussian kernel's extra channel per head.
        num_heads: Heads; they split the key and the value channels.
        kernel: ``'dot'`` (the report's default) or ``'gaussian'`` (the HyperBF kernel's widths, one per head,
            starting at 1/2 so that ``-gamma ||q - k||^2`` keeps the ``q . k`` term of the dot product). Zero queries
            then give ``softmax_i(-gamma_h ||k_{i,h}||^2)``, uniform only where the keys of a head have equal norms.
        key_norm: ``''``, ``'l2'`` or ``'rms'``: the normalisation of stored keys, per head.
        path_drop: Dropout on the read's attention weights in training (the report's path dropout).
        query: Whether the sublayer reads (has a query); zero queries (the init) read the uniform average.
    """
    num_heads: Final[int]
    key_norm: Final[str]
    gaussian: Final[bool]
    rms_logits: Final[bool]
    path_drop: Final[float]

    def __init__(
            self,
            key_dim: int,
            num_heads: int,
            kernel: str = 'dot',
            key_norm: str = '',
            path_drop: float = 0.,
            query: bool = True,
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
        self.key_dim = key_dim
        self.key_norm = key_norm
        self.gaussian = kernel == 'gaussian'
        self.rms_logits = key_norm == 'rms' and not self.gaussian
        self.path_drop = path_drop
        self.query = nn.Parameter(torch.zeros(num_heads, key_dim // num_heads, **dd)) if query else None
        self.kernel = HyperBFKernel(key_dim // num_heads, num_heads, gamma_init=.5, **dd) \
            if self.gaussian and query else None

    def init_weights(self) -> None:
        if self.query is not None:
            nn.init.zeros_(self.query)

    def memory_query(self) -> torch.Tensor:
        """The query as the memory uses it, ``(H, Dk', 1)`` (``[2 gamma_h q_h, -gamma_h]`` per head for the Gaussian
        kernel)."""
        query = self.query
        assert query is not None, 'a sublayer that does not read has no query'
        if self.kernel is not None:
            gamma = self.kernel.gamma().unsqueeze(-1).to(query.dtype)
            query = torch.cat([2. * gamma * query, -gamma], dim=-1)
        return query.unsqueeze(-1)

    def key(self, key: torch.Tensor) -> torch.Tensor:
        """A key ``(..., H * Dk)`` as the memory stores it: normalised per head, then ``[k_h, ||k_h||^2]`` per head
        for the Gaussian kernel (RMS-normalised keys of the dot product are stored as they are: the logits apply the
        norm)."""
        if self.key_norm == '' and not self.gaussian or self.rms_logits:
            return key
        k = key.unflatten(-1, (self.num_heads, -1))
        if self.key_norm == 'l2':
            k = F.normalize(k, dim=-1)
        elif self.key_norm == 'rms':
            k = F.rms_norm(k, [k.shape[-1]], eps=1e-6)
        if self.gaussian:
            k = torch.cat([k, k.pow(2).sum(-1, keepdim=True)], dim=-1)
        return k.flatten(-2)

    def start(self, queries: torch.Tensor, keep: Optional[torch.Tensor], value: torch.Tensor) -> DepthMemory:
        """An empty memory for the reads of ``queries`` (``keep``: their path-dropout keep probabilities), for
        entries of ``value``'s rank."""
        state = queries.new_zeros([1] * (value.dim() - 1) + [self.num_heads, queries.shape[-1]],
                                  dtype=accumulation_dtype(queries))
        return DepthMemory(queries, keep, state - math.inf, state, state.unsqueeze(-1), queries.new_zeros(0),
                           value.new_zeros(0))

    def write(
            self,
            memory: DepthMemory,
            key: Optional[torch.Tensor],
            value: torch.Tensor,
            position: int = 0,
            commit: bool = True,
    ) -> DepthMemory:
        """The memory with an entry written: ``key`` None takes the key from the value (AttnRes). Past the first
        place of a memory block (``position > 0``) the entry is merged into the block's running summary; ``commit``
        adds the entry (the summary) to the sums of every later read, as at the end of a block."""
        if key is not None:
            key = self.key(key)
        if position > 0:
            dtype = accumulation_dtype(value)
            value = memory.value.to(dtype) + value
            if key is not None:
                key = torch.lerp(memory.key.to(dtype), key.to(dtype), 1. / (position + 1))
        if key is None:
            key = self.key(value)
        if not commit:
            return DepthMemory(memory.queries, memory.keep, memory.max, memory.norm, memory.acc, key, value)
        state = _accumulate((memory.max, memory.norm, memory.acc), depth_logits(key, memory.queries, self.rms_logits),
                            value.unflatten(-1, (self.num_heads, 1, -1)), memory.keep if self.training else None)
        return DepthMemory(memory.queries, memory.keep, state[0], state[1], state[2], key, value)

    def forward(self, memory: DepthMemory, merge: bool = False) -> Tuple[torch.Tensor, DepthMemory]:
        """``A = S / Z`` of the next read (Eq. 1), ``(..., D)`` in the query's dtype, with the running summary of the
        block merged in (``merge``); and the memory without that read."""
        queries, keep = memory.queries, memory.keep
        rest = queries.shape[-1] - 1
        (max_, max_rest), (norm, norm_rest), (acc, acc_rest) = (
            memory.max.split([1, rest], -1), memory.norm.split([1, rest], -1), memory.acc.split([1, rest], -2))
        state = (max_, norm, acc)
        if merge:
            drop = keep[:1] if keep is not None and self.training else None
            state = _accumulate(state, depth_logits(memory.key, queries[..., :1], self.rms_logits),
                                memory.value.unflatten(-1, (self.num_heads, 1, -1)), drop)
            acc = state[2]
        else:
            acc = state[2].clone()  # the division keeps its input: a copy of this read's sum, not of every read's
        out = (acc / state[1].unsqueeze(-1)).flatten(-3)
        return out.to(queries.dtype), DepthMemory(queries[..., 1:], None if keep is None else keep[1:], max_rest,
                                                  norm_rest, acc_rest, memory.key, memory.value)

    def extra_repr(self) -> str:
        return f'num_heads={self.num_heads}, key_norm={self.key_norm!r}, path_drop={self.path_drop}'


def normalized_entropy(weights: torch.Tensor) -> torch.Tensor:
    """Entropy of attention weights over entries (the last dim), divided by ``log(L)``: 1 for a uniform average (what
    a residual stream computes), 0 for a single entry. The report's entropy metric, averaged over all other dims."""
    entropy = -(weights * weights.clamp_min(1e-30).log()).sum(-1).mean()
    num = weights.shape[-1]
    return entropy / math.log(num) if num > 1 else torch.zeros_like(entropy)


def depth_weights(queries: torch.Tensor, keys: List[torch.Tensor], rms: bool = False) -> torch.Tensor:
    """Eq. 1's weights computed directly from stored ``keys`` for the queries ``(H, Dk', R)``: ``(..., H, R, L)``
    (the reference for the memory's sums, and diagnostics)."""
    logits = [depth_logits(k, queries, rms) for k in keys]
    return torch.stack(torch.broadcast_tensors(*logits), -1).softmax(-1)
