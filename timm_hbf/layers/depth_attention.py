"""Attention over depth: a sublayer's read of, and write to, a per-token memory of earlier outputs (QIMIA, Dugue 2023,
report Eq. 1-2; Attention Residuals, Kimi Team 2026, Eq. 2-4; Block AttnRes, Eq. 6).

Every reading sublayer ``l`` owns a learned query ``q_l`` and reads, per token and head ``h`` (heads split keys and
values into contiguous groups), the (key, value) entries that the stem and the earlier sublayers wrote:

    A_l = sum_i softmax_i(s_{l,i}) v_{i,h}                                                   (Eq. 1)
    s_{l,i} = q_{l,h} . k_{i,h}   (dot kernel),   -gamma_{l,h} ||q_{l,h} - k_{i,h}||^2   (Gaussian kernel)

The queries do not depend on the input, so an entry's logits for every later read are computed once, when stored.
The memory (:class:`DepthMemory`) is plain tensors and lists in every execution mode; a read sums one product per
entry (the backward pass keeps the values, no stacked copy), in float32 or wider. Block memory sums the entries of
``n`` consecutive sublayers into one summary, stored when the block ends; a read in a block takes the running summary.
"""
from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.jit import Final

from .._checks import check_choice, check_count, check_divisor, check_rate
from .hyperbf_kernel import HyperBFKernel, accumulation_dtype

__all__ = ['DEPTH_KERNELS', 'DepthAttention', 'DepthMemory', 'depth_logits', 'depth_read']

DEPTH_KERNELS = ('dot', 'gaussian')
KEY_NORMS = ('', 'l2', 'rms')


class DepthMemory(NamedTuple):
    """The state of attention over depth between sublayers, ``R`` reads to come."""
    queries: torch.Tensor  # (H, Dk', R) the queries of the reads to come, as DepthAttention.memory_query gives them
    values: List[torch.Tensor]  # the stored entries' values, (..., D) each, or shared by the batch or the tokens
    logits: List[List[torch.Tensor]]  # for each read to come, its logits (..., H) over the stored entries
    key: torch.Tensor  # the newest entry's stored key (..., H * Dk'), in block memory the running summary's
    value: torch.Tensor  # its value (..., D)


def _depth_logits(key: torch.Tensor, queries: torch.Tensor, rms: bool) -> torch.Tensor:
    dtype = accumulation_dtype(queries)
    k = key.to(dtype).unflatten(-1, (queries.shape[0], -1))
    logits = torch.einsum('...hd,hdr->...hr', k, queries.to(dtype))
    if rms:  # RMS-normalised keys: the norm's scale applied to the product, no normalised copy of the key kept
        logits = logits * k.pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt()
    return logits


def depth_logits(key: torch.Tensor, queries: torch.Tensor, rms: bool = False) -> torch.Tensor:
    """``s_{l,i}`` of one entry for every read: stored ``key (..., H * Dk')``, ``queries (H, Dk', R)`` ->
    ``(..., H, R)``, in float32 (or wider), also under autocast. ``rms``: the key RMS-normalised per head first."""
    if not torch.jit.is_scripting() and key.device.type != 'meta':  # TorchScript has no autocast to turn off
        with torch.autocast(key.device.type, enabled=False):
            return _depth_logits(key, queries, rms)
    return _depth_logits(key, queries, rms)


torch.fx.wrap('depth_logits')  # a leaf for torch.fx: no autocast device from a traced tensor


def depth_read(logits: List[torch.Tensor], values: List[torch.Tensor], drop: float = 0.) -> torch.Tensor:
    """Eq. 1 over ``L`` entries: ``sum_i softmax_i(s_i) v_i`` of logits ``(..., H)`` and values ``(..., H * Dv)``, in
    the logits' dtype (no autocast op is involved); ``drop``: dropout on the weights (the report's path dropout)."""
    weights = F.dropout(torch.stack(logits).softmax(0), drop)
    heads = weights.shape[-1]
    out = weights[0].unsqueeze(-1) * values[0].unflatten(-1, (heads, -1))
    for i in range(1, len(values)):  # a product per entry: the backward pass keeps the values, not a stack of them
        out = torch.addcmul(out, weights[i].unsqueeze(-1), values[i].unflatten(-1, (heads, -1)))
    return out.flatten(-2)


class DepthAttention(nn.Module):
    """A sublayer's read of the depth memory (Eq. 1, :meth:`forward`) and its write (:meth:`write`).

    Args:
        key_dim: Key width (the query's), before the Gaussian kernel's extra channel per head.
        num_heads: Heads; they split the key and the value channels.
        kernel: ``'dot'`` or ``'gaussian'`` (HyperBF widths per head from 1/2: zero queries weigh by ``||k_h||``).
        key_norm: ``''``, ``'l2'`` (the report's) or ``'rms'`` (AttnRes's): the stored keys' norm, per head.
        path_drop: Dropout on the read's weights in training (the report's path dropout).
        query: Whether it reads (else it takes the newest entry); zero queries (the init) read the uniform average.
        position: The sublayer's place in its memory block of ``block_size`` (1: every entry is stored).
    """
    num_heads: Final[int]
    key_norm: Final[str]
    gaussian: Final[bool]
    rms_logits: Final[bool]
    path_drop: Final[float]
    position: Final[int]
    commit: Final[bool]

    def __init__(
            self,
            key_dim: int,
            num_heads: int,
            kernel: str = 'dot',
            key_norm: str = '',
            path_drop: float = 0.,
            query: bool = True,
            position: int = 0,
            block_size: int = 1,
            device: torch.types.Device = None,
            dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        for name, count in (('key_dim', key_dim), ('num_heads', num_heads), ('block_size', block_size)):
            check_count(name, count)
        check_divisor('num_heads', num_heads, 'key_dim', key_dim)
        check_choice('kernel', kernel, DEPTH_KERNELS)
        check_choice('key_norm', key_norm, KEY_NORMS)
        check_rate('path_drop', path_drop)
        dd = {'device': device, 'dtype': dtype}
        self.num_heads = num_heads
        self.key_norm = key_norm
        self.gaussian = kernel == 'gaussian'
        self.rms_logits = key_norm == 'rms' and not self.gaussian
        self.path_drop = path_drop
        self.position = position % block_size
        self.commit = self.position == block_size - 1
        self.query = nn.Parameter(torch.zeros(num_heads, key_dim // num_heads, **dd)) if query else None
        self.kernel = HyperBFKernel(key_dim // num_heads, num_heads, gamma_init=.5, **dd) \
            if self.gaussian and query else None

    def init_weights(self) -> None:
        if self.query is not None:
            nn.init.zeros_(self.query)

    def memory_query(self) -> torch.Tensor:
        """The query as the memory uses it, ``(H, Dk', 1)`` (Gaussian kernel: ``[2 gamma_h q_h, -gamma_h]``)."""
        query = self.query
        assert query is not None, 'a sublayer that does not read has no query'
        if self.kernel is not None:
            gamma = self.kernel.gamma().unsqueeze(-1).to(query.dtype)
            query = torch.cat([2. * gamma * query, -gamma], dim=-1)
        return query.unsqueeze(-1)

    def memory_queries(self) -> List[torch.Tensor]:
        """:meth:`memory_query` in a list, empty where the sublayer does not read."""
        return [] if self.query is None else [self.memory_query()]

    def key(self, key: torch.Tensor) -> torch.Tensor:
        """A key ``(..., H * Dk)`` as the memory stores it: normalised per head, ``[k_h, ||k_h||^2]`` for the Gaussian
        kernel (RMS-normalised keys of the dot kernel as they are: the logits apply the norm)."""
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

    def start(self, queries: List[torch.Tensor]) -> DepthMemory:
        """An empty memory for the reads of ``queries`` (``(H, Dk', 1)`` each, in reading order)."""
        logits: List[List[torch.Tensor]] = [[] for _ in queries]
        empty = queries[0].new_zeros(0)
        return DepthMemory(torch.cat(queries, dim=-1), [], logits, empty, empty)

    def store(self, memory: DepthMemory, key: torch.Tensor, value: torch.Tensor,
              tokens: Optional[torch.Tensor] = None) -> DepthMemory:
        """The memory with an entry stored (``key`` as :meth:`key` gives it), with its logits for every read to come;
        an entry shared by the batch or the tokens takes the shape of ``tokens (..., D)`` in the logits alone."""
        logits = depth_logits(key, memory.queries, self.rms_logits)  # (..., H, R)
        if tokens is not None:
            logits = logits.expand(tokens.shape[:-1] + logits.shape[-2:])
        columns = logits.unbind(-1)  # one gradient for all of them in the backward pass, stacked
        reads = [read + [columns[r]] for r, read in enumerate(memory.logits)]
        return DepthMemory(memory.queries, memory.values + [value], reads, key, value)

    def write(self, memory: DepthMemory, key: Optional[torch.Tensor], value: torch.Tensor) -> DepthMemory:
        """This sublayer's write (``key`` None: from the value). Past a memory block's first place the entry merges into
        its running summary (values summed, learned keys averaged); the block's last sublayer stores the summary."""
        if key is not None:
            key = self.key(key)
        if self.position > 0:
            dtype = accumulation_dtype(value)
            value = memory.value.to(dtype) + value
            if key is not None:
                key = torch.lerp(memory.key.to(dtype), key.to(dtype), 1. / (self.position + 1))
        if key is None:
            key = self.key(value)
        if self.commit:
            return self.store(memory, key, value)
        return DepthMemory(memory.queries, memory.values, memory.logits, key, value)

    def forward(self, memory: DepthMemory) -> Tuple[torch.Tensor, DepthMemory]:
        """The next read (Eq. 1) over the stored entries (past a memory block's first place, the running summary too)
        in the query's dtype, and the memory without that read."""
        if self.query is None:
            return memory.value, memory
        queries, logits, values = memory.queries, memory.logits[0], memory.values
        if self.position > 0:
            logits = logits + [depth_logits(memory.key, queries[..., :1], self.rms_logits)[..., 0]]
            values = values + [memory.value]
        out = depth_read(logits, values, self.path_drop if self.training else 0.)
        rest = DepthMemory(queries[..., 1:], memory.values, memory.logits[1:], memory.key, memory.value)
        return out.to(queries.dtype), rest
