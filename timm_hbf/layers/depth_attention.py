"""Attention over depth: a sublayer's read of, and write to, a per-token memory of earlier outputs (QIMIA, Dugue 2023,
report Eq. 1, repeated as Eq. 2; Attention Residuals, Kimi Team 2026).

Every reading sublayer ``l`` owns a learned query ``q_l`` and reads, per token and per head ``h``, the (key, value)
entries that the stem and the earlier sublayers wrote:

    A_l = sum_i w_{l,i} v_{i,h},   w_{l,i} = softmax_i(s_{l,i})                                 (Eq. 1)
    s_{l,i} = q_{l,h} . k_{i,h}                              dot-product kernel (Eq. 1)
    s_{l,i} = -gamma_{l,h} ||q_{l,h} - k_{i,h}||^2           Gaussian kernel, the report's L2 attention

Heads split the key and the value channels into contiguous groups. The queries do not depend on the input, so an
entry's logits for every later read are known once it is written (AttnRes's two-phase computation). The memory
(:class:`DepthMemory`) stacks the entries' values, and their logits for every read still to come, reads outermost;
a read is one softmax over its row of the stacked logits and one weighted sum of the stacked values: a fixed
number of operations whatever the depth. Logits and sums are float32 (or wider) whatever the entries' dtype, also
under autocast.

In eager mode, a write puts the entry into the free room of the stack's storage (:func:`append_entry`), so that every
read keeps its stack for the backward pass without a copy: ``O(L)`` memory for ``L`` entries, not ``O(L^2)``; in the
backward pass, the reads of a stack add their gradients in place into the one its next write passes on, and each read
writes its logits' gradient into a free row above the later reads' (:class:`_FirstRow`); a read forms its
products in scratch room of half a stack, not in new memory of the stack's size. Compiled, exported and
scripted, the entries and their logits are lists, and a read sums one term per entry (one kernel once compiled),
which keeps no copy of them either.

Keys are stored as reads use them: unit L2 per head (``'l2'``, the report's key normalisation) or RMS-normalised per
head (``'rms'``, AttnRes's keys, the values normalised); for the Gaussian kernel with ``||k_h||^2`` appended per head,
and queries as ``[2 gamma_h q_h, -gamma_h]``, so that one product gives ``gamma_h (2 q_h . k_h - ||k_h||^2)``, the
Gaussian logit up to ``-gamma_h ||q_h||^2``, which the softmax cancels.

Block memory (Block AttnRes): the entries of ``n`` consecutive sublayers add up into one summary (values summed, a
residual stream within the block; learned keys averaged, so that its logit is its members' mean logit; AttnRes's keys
recomputed from the sum). A summary is stored when its block ends; a read inside a block takes the running summary
as one more entry (the intra-block phase).
"""
import math
import weakref
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
    """The state of attention over depth between sublayers: the stored entries, stacked, and the running summary of
    an unfinished block. ``R`` reads are still to come, the next one first; ``...`` is ``(B, N)``."""
    queries: torch.Tensor  # (H, Dk', R) the reads' queries as :meth:`DepthAttention.memory_query` gives them
    keep: Optional[torch.Tensor]  # (R,) each read's path-dropout keep probability, None without path dropout
    logits: torch.Tensor  # (R, L, ..., H) s_{l,i} for every read l to come of every stored entry i
    values: torch.Tensor  # (L, ..., D) the stored entries' values, in the logits' dtype (eager mode)
    scratch: torch.Tensor  # (C, ..., D) room for a read's products over C entries at a time (eager mode)
    entries: List[torch.Tensor]  # compiled, exported, scripted: the stored values, a list
    entry_logits: List[torch.Tensor]  # and their logits for the reads to come, (R, ..., H) each
    key: torch.Tensor  # (..., H * Dk') the newest entry's stored key, in block memory the running summary's
    value: torch.Tensor  # (..., D) its value


def _product(k: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """``k_h . q_{h,r}`` of keys ``(..., H, Dk')`` and queries ``(H, Dk', R)`` -> ``(..., H, R)``."""
    if queries.shape[0] == 1:  # one head: a plain product
        return k @ queries[0]
    return torch.einsum('...hd,hdr->...hr', k, queries)


def _rstd(k: torch.Tensor) -> torch.Tensor:
    """``(mean(k_h^2) + eps)^(-1/2)`` over the last dim of keys ``(..., H, Dk')``: the RMS norm's scale."""
    return k.pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt()


class _RMSLogits(torch.autograd.Function):
    """``rstd_h (k_h . q_{h,r})``, ``rstd_h = (mean(k_h^2) + eps)^(-1/2)``: the logits of RMS-normalised keys ``(..., H,
    Dk')``, whose gradient is formed in a few products from the key, ``rstd`` and the logits, and keeps no normalised
    copy of the key: ``dk_h = rstd_h g_h q_h^T - (rstd_h^2 / Dk') (g_h . s_h) k_h``."""

    @staticmethod
    def forward(ctx, k, queries):
        rstd = _rstd(k)
        logits = _product(k, queries).mul_(rstd)
        ctx.save_for_backward(k, queries, rstd, logits)
        return logits

    @staticmethod
    def backward(ctx, grad):
        k, queries, rstd, logits = ctx.saved_tensors
        scaled = grad * rstd
        grad_k = grad_q = None
        if ctx.needs_input_grad[0]:
            grad_k = _product(scaled, queries.transpose(1, 2))
            grad_k.addcmul_(k, torch.linalg.vecdot(scaled, logits).unsqueeze(-1) * rstd, value=-1. / k.shape[-1])
        if ctx.needs_input_grad[1]:
            if queries.shape[0] == 1:
                grad_q = (k.reshape(-1, k.shape[-1]).t() @ scaled.reshape(-1, scaled.shape[-1])).unsqueeze(0)
            else:
                grad_q = torch.einsum('...hd,...hr->hdr', k, scaled)
        return grad_k, grad_q


def _depth_logits(key: torch.Tensor, queries: torch.Tensor, rms: bool) -> torch.Tensor:
    dtype = accumulation_dtype(queries)
    k = key.to(dtype).unflatten(-1, (queries.shape[0], -1))
    queries = queries.to(dtype)
    if rms:  # RMS-normalised keys (the values): the norm applied to the product, no normalised copy kept
        if not torch.jit.is_scripting():
            if not torch.compiler.is_compiling():
                return _RMSLogits.apply(k, queries)
        return _product(k, queries) * _rstd(k)
    return _product(k, queries)


def depth_logits(key: torch.Tensor, queries: torch.Tensor, rms: bool = False) -> torch.Tensor:
    """``s_{l,i}`` of one entry for every read: stored ``key (..., H * Dk')``, ``queries (H, Dk', R)`` ->
    ``(..., H, R)``, in float32 (or wider), also under autocast. ``rms``: the key RMS-normalised per head first."""
    if not torch.jit.is_scripting() and key.device.type != 'meta':
        with torch.autocast(key.device.type, enabled=False):
            return _depth_logits(key, queries, rms)
    return _depth_logits(key, queries, rms)


torch.fx.wrap('depth_logits')  # a leaf for torch.fx: it cannot take the autocast device from a traced tensor


def _contiguous(shape: List[int]) -> List[int]:
    """The strides of a contiguous tensor of ``shape``."""
    strides = [1]
    for size in shape[:0:-1]:
        strides.insert(0, strides[0] * size)
    return strides


def _on(storage: torch.UntypedStorage, like: torch.Tensor, offset: int, shape, stride) -> torch.Tensor:
    """A tensor of ``like``'s dtype on ``storage``: the same memory as any other tensor there, but not a view of it,
    so that writing one does not invalidate the other for autograd."""
    return like.new_empty(0).set_(storage, offset, shape, stride)


class _Append(torch.autograd.Function):
    """``cat([stack, entry.unsqueeze(dim)], dim)`` (and, with ``with_row``, the new row), written into the free room
    of ``stack``'s storage (grown by doubling when it has none); along dim 1 (the logits, reads outermost), the
    entry's last dim is the stack's first. What ``stack`` covers is never written again, so every
    earlier stack keeps its values and no read's stack is a copy.

    The backward pass hands the gradient of ``stack`` (a slice of the new stack's) to the reads of ``stack`` as well
    as to autograd: :class:`_WeightedSum` adds into it in place rather than returning a stack-sized gradient of its
    own. A weak reference: the gradient lives no longer than the backward pass that made it."""

    @staticmethod
    def forward(ctx, stack, entry, with_row, dim):
        rows, stride = stack.shape[dim], stack.stride()
        shape = stack.shape[:dim] + (rows + 1,) + stack.shape[dim + 1:]
        storage, offset = stack.untyped_storage(), stack.storage_offset()
        end = offset + sum((size - 1) * step for size, step in zip(shape, stride))  # the new row's last element
        full = end >= storage.nbytes() // stack.element_size()
        if dim > 0:  # and, past dim 0, up to the next index of the dim before
            full = full or (rows + 1) * stride[dim] > stride[dim - 1]
        if full:
            grown = stack.new_empty(stack.shape[:dim] + (2 * rows + 1,) + stack.shape[dim + 1:])
            grown.narrow(dim, 0, rows).copy_(stack)
            storage, offset, stride = grown.untyped_storage(), 0, grown.stride()
        out = _on(storage, stack, offset, shape, stride)
        row = _on(storage, stack, offset + rows * stride[dim], shape[:dim] + shape[dim + 1:],
                  stride[:dim] + stride[dim + 1:]) if with_row else out.select(dim, rows)
        (row if dim == 0 else row.movedim(0, -1)).copy_(entry)
        ctx.rows, ctx.dim, ctx.entry_shape, ctx.entry_dtype = rows, dim, entry.shape, entry.dtype
        ctx.below = stack.grad_fn if isinstance(stack.grad_fn, _Append._backward_cls) else None
        ctx.pending = None
        ctx.set_materialize_grads(False)
        return (out, row) if with_row else out

    @staticmethod
    def backward(ctx, grad, grad_row=None):
        if grad is None:
            return (None, None if grad_row is None else grad_row.sum_to_size(ctx.entry_shape).to(ctx.entry_dtype),
                    None, None)
        entry = grad.select(ctx.dim, ctx.rows)
        entry = entry.movedim(0, -1) if ctx.dim else entry
        entry = entry if grad_row is None else entry + grad_row
        rest = grad.narrow(ctx.dim, 0, ctx.rows)
        if ctx.below is not None and not torch.is_grad_enabled():
            ctx.below.pending = weakref.ref(rest)
        return rest, entry.sum_to_size(ctx.entry_shape).to(ctx.entry_dtype), None, None


def _eager() -> bool:
    """Not compiling, exporting or scripting: the memory's stacks are written in place."""
    if not torch.jit.is_scripting():
        return not torch.compiler.is_compiling()
    return False


def append_entry(stack: torch.Tensor, entry: torch.Tensor, with_row: bool = False, dim: int = 0
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``stack`` with ``entry`` (broadcast; along dim 1, its last dim first) as its next index along ``dim``, in
    ``stack``'s dtype, and that row as stored (in eager mode only ``with_row``; else ``entry`` as it is). Compiled,
    exported and scripted, where the memory keeps lists instead, a plain concatenation."""
    if not torch.jit.is_scripting():
        if not torch.compiler.is_compiling():
            out = _Append.apply(stack, entry, with_row, dim)
            return out if with_row else (out, entry)
    shape = stack.shape[:dim] + stack.shape[dim + 1:]
    row = entry.to(stack.dtype)
    row = row.expand(shape[1:] + shape[:1]).movedim(-1, 0) if dim else row.expand(shape)
    return torch.cat([stack, row.unsqueeze(dim)], dim), row


def new_stacks(queries: torch.Tensor, value: torch.Tensor, num_heads: int, capacity: int) -> List[torch.Tensor]:
    """Empty stacks of logits ``(R, 0, ..., H)`` and values ``(0, ..., D)`` for entries of ``value``'s shape, with room
    for ``capacity`` values, and (in eager mode) scratch room for the products of reads over half as many at a time.
    The logits start with room for two entries: each time they double, they keep only the reads still to come."""
    dtype = accumulation_dtype(queries)
    logits = queries.new_empty([queries.shape[-1], min(capacity, 2)] + list(value.shape[:-1]) + [num_heads],
                               dtype=dtype)
    values = value.new_empty([capacity] + list(value.shape), dtype=dtype)
    scratch = value.new_empty([(capacity + 1) // 2 if _eager() else 0] + list(value.shape), dtype=dtype)
    return [logits[:, :0], values[:0], scratch]


def _weighted_sum(weights: torch.Tensor, values: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """``sum_i w_i v_i`` of ``weights (L, ..., H, 1)`` and ``values (L, ..., H, Dv)`` -> ``(..., H, Dv)``, summed in two
    halves whose products go into ``scratch (C, ...)`` (``L <= 2 C``): no product of the stack's size is allocated
    per read. Written through an alias (:func:`_on`), so that ``scratch`` itself never changes for autograd (it passes
    through gradient checkpointing as an input of every layer)."""
    num = values.shape[0]
    if not torch.jit.is_scripting():  # eager mode only: the compiler fuses the products into the sum
        if not torch.compiler.is_compiling() and 0 < num <= 2 * scratch.shape[0] \
                and scratch.shape[1:].numel() == values.shape[1:].numel():
            half = (num + 1) // 2
            out = None
            for part, w in zip(values.split(half), weights.split(half)):
                room = _on(scratch.untyped_storage(), scratch, scratch.storage_offset(), part.shape,
                           _contiguous(part.shape))
                term = torch.mul(part, w, out=room).sum(0)
                out = term if out is None else out.add_(term)
            return out
    return (weights * values).sum(0)


# leaves for torch.fx, which can neither trace into an autograd Function nor build shapes from traced tensors
torch.fx.wrap('append_entry')
torch.fx.wrap('new_stacks')


class _WeightedSum(torch.autograd.Function):
    """``sum_i w_i v_i`` of ``weights (L, ..., H)`` and a stack of values ``(L, ..., H * Dv)``. The backward pass
    adds ``w_i g`` in place into the stack's gradient where the next write has made it (:class:`_Append`), so that
    the reads of a stack and its next write share one gradient of its size."""

    @staticmethod
    def forward(ctx, weights, stack, scratch):
        values = stack.unflatten(-1, (weights.shape[-1], -1))
        ctx.save_for_backward(weights, values)
        ctx.creator = stack.grad_fn if isinstance(stack.grad_fn, _Append._backward_cls) else None
        return _weighted_sum(weights.unsqueeze(-1), values, scratch).flatten(-2)

    @staticmethod
    def backward(ctx, grad):
        weights, values = ctx.saved_tensors
        grad = grad.unflatten(-1, values.shape[-2:])
        pending = None if ctx.creator is None or ctx.creator.pending is None else ctx.creator.pending()
        grad_stack = None
        if pending is not None and pending.is_contiguous() and not torch.is_grad_enabled():
            pending.view(values.shape).addcmul_(weights.unsqueeze(-1), grad)
        else:  # no next write, or one that autograd did not run (yet): a gradient of its own
            grad_stack = (weights.unsqueeze(-1) * grad).flatten(-2)
        if values.shape[1:] != grad.shape:  # values broadcast over the batch or the tokens
            return torch.einsum('...hd,l...hd->l...h', grad, values), grad_stack, None
        num, width = values.shape[0], values.shape[-1]  # the weights' gradient: a dot product per token and entry
        dots = torch.bmm(grad.reshape(-1, 1, width), values.reshape(num, -1, width).permute(1, 2, 0))
        return dots.view(-1, num).t().unflatten(1, values.shape[1:-1]), grad_stack, None


class _FirstRow(torch.autograd.Function):
    """``(stack[0], stack[1:])`` of a stack of logits ``(R, L, ...)``: the next read's logits, and the stack for the
    reads after it, on the same storage but not a view of it (:func:`_on`), so that the next write appends to it in
    place. The backward pass puts both gradients into one tensor with free rows above them (twice as many rows as
    the stack it covers): the read before this one writes its row there in place, so that a stack's gradient is
    copied only when that room runs out, not on every read."""

    @staticmethod
    def forward(ctx, stack):
        ctx.set_materialize_grads(False)
        ctx.shape = stack.shape
        shape = (stack.shape[0] - 1,) + stack.shape[1:]
        rest = _on(stack.untyped_storage(), stack, stack.storage_offset() + stack.stride(0), shape, stack.stride())
        return stack[0], rest

    @staticmethod
    def backward(ctx, grad, grad_rest):
        like = grad if grad is not None else grad_rest
        if like is None:
            return None
        out = _room_above(grad_rest, ctx.shape)
        if out is None:
            rows = ctx.shape[0]
            room = like.new_empty((2 * rows,) + ctx.shape[1:])
            room.has_room_above = True
            out = room[rows:]
            if grad_rest is None:
                out[1:].zero_()
            else:
                out[1:].copy_(grad_rest)
        if grad is None:
            out[0].zero_()
        else:
            out[0].copy_(grad)
        return out


def _room_above(grad: Optional[torch.Tensor], shape: Tuple[int, ...]) -> Optional[torch.Tensor]:
    """A tensor of ``shape`` whose rows ``1:`` are ``grad`` itself, where ``grad`` is rows of a gradient made by
    :class:`_FirstRow` (their first indices along dim 1) with a free row above them; else None."""
    room = None if grad is None or torch.is_grad_enabled() else grad._base
    if room is None or not getattr(room, 'has_room_above', False) or room.stride() != grad.stride() \
            or room.shape[2:] != grad.shape[2:] or shape[1:] != grad.shape[1:]:
        return None
    row, column = divmod(grad.storage_offset() - room.storage_offset(), room.stride(0))
    if row < 1 or column != 0 or row + grad.shape[0] != room.shape[0]:
        return None
    return room[row - 1:row + grad.shape[0], :shape[1]]


def first_row(stack: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(stack[0], stack[1:])`` of the logits ``stack (R, L, ...)``: the next read's logits over the stored entries,
    and the stack of the reads after it."""
    if not torch.jit.is_scripting():
        if not torch.compiler.is_compiling():
            return _FirstRow.apply(stack)
    return stack[0], stack[1:]


torch.fx.wrap('first_row')  # a leaf for torch.fx, which cannot trace into an autograd Function


def _depth_read(
        logits: torch.Tensor,
        values: torch.Tensor,
        scratch: torch.Tensor,
        entries: List[torch.Tensor],
        own: Optional[Tuple[torch.Tensor, torch.Tensor]],
        keep: Optional[torch.Tensor],
        num_heads: int,
) -> torch.Tensor:
    if own is not None:
        logits = torch.cat([logits, own[0].expand_as(logits[0]).unsqueeze(0)])
    weights = logits.softmax(0)
    if keep is not None:  # dropout on the weights: the normaliser stays
        weights = weights * torch.bernoulli(keep.expand_as(weights)) / keep
    stored = weights if own is None else weights[:-1]
    if len(entries) > 0:  # compiled, exported, scripted: a term per entry, which the backward pass keeps no copy of
        out = stored.new_zeros(0)
        for i, entry in enumerate(entries):
            term = stored[i].unsqueeze(-1) * entry.to(stored.dtype).unflatten(-1, (num_heads, -1))
            out = term if i == 0 else out + term
        out = out.flatten(-2)
    elif not torch.jit.is_scripting() and torch.is_grad_enabled():
        out = _WeightedSum.apply(stored, values, scratch)
    else:
        out = _weighted_sum(stored.unsqueeze(-1), values.unflatten(-1, (num_heads, -1)), scratch).flatten(-2)
    if own is not None:
        out = torch.addcmul(out.unflatten(-1, (num_heads, -1)), weights[-1].unsqueeze(-1),
                            own[1].to(out.dtype).unflatten(-1, (num_heads, -1))).flatten(-2)
    return out


def depth_read(
        logits: torch.Tensor,
        values: torch.Tensor,
        entries: List[torch.Tensor],
        own: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
        keep: Optional[torch.Tensor] = None,
        num_heads: int = 1,
        scratch: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Eq. 1 over stored entries, in their dtype (float32 or wider), also under autocast: ``softmax_i`` of
    ``logits (L, ..., H)`` weighing ``values (L, ..., H * Dv)`` -> ``(..., H * Dv)``. ``own``: the logits
    ``(..., H)`` and value ``(..., H * Dv)`` of one more entry (a block's running summary); ``keep``: the keep
    probability of dropout on the weights; ``scratch``: room ``(C, ..., H * Dv)`` for the products of up to ``2 C``
    entries, in two halves (:class:`DepthMemory`)."""
    room = values.new_empty(0) if scratch is None else scratch
    if not torch.jit.is_scripting() and values.device.type != 'meta':
        with torch.autocast(values.device.type, enabled=False):
            return _depth_read(logits, values, room, entries, own, keep, num_heads)
    return _depth_read(logits, values, room, entries, own, keep, num_heads)


torch.fx.wrap('depth_read')  # a leaf for torch.fx: it cannot take the autocast device from a traced tensor


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

    def start(
            self,
            queries: torch.Tensor,
            keep: Optional[torch.Tensor],
            value: torch.Tensor,
            capacity: int = 0,
    ) -> DepthMemory:
        """An empty memory for the reads of ``queries`` (``keep``: their path-dropout keep probabilities), for
        entries of ``value``'s shape, with room for ``capacity`` entries (it grows past them)."""
        logits, values, scratch = new_stacks(queries, value, self.num_heads, capacity)
        return DepthMemory(queries, keep, logits, values, scratch, [], [], queries.new_zeros(0), value.new_zeros(0))

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
        stores the entry (the summary) with its logits for every later read, as at the end of a block."""
        from_value = key is None
        if key is not None:
            key = self.key(key)
        if position > 0:
            dtype = accumulation_dtype(value)
            value = memory.value.to(dtype) + value
            if key is not None:
                key = torch.lerp(memory.key.to(dtype), key.to(dtype), 1. / (position + 1))
        if key is None:
            key = self.key(value)
        logits, values, entries, entry_logits = memory.logits, memory.values, memory.entries, memory.entry_logits
        if commit and _eager():
            key_is_row = from_value and self.rms_logits  # the key is the stored row: the entry is not kept for backward
            values, row = append_entry(values, value, key_is_row)
            if key_is_row:
                key = row
            logits, _ = append_entry(logits, depth_logits(key, memory.queries, self.rms_logits), dim=1)
        elif commit:
            entries = entries + [value]
            entry_logits = entry_logits + [depth_logits(key, memory.queries, self.rms_logits).movedim(-1, 0)
                                           .contiguous()]  # reads outermost, as the stack
        return DepthMemory(memory.queries, memory.keep, logits, values, memory.scratch, entries, entry_logits, key,
                           value)

    def forward(self, memory: DepthMemory, merge: bool = False) -> Tuple[torch.Tensor, DepthMemory]:
        """The next read (Eq. 1) over the stored entries (and the running summary, with ``merge``: the intra-block
        phase), ``(..., D)`` in the query's dtype; and the memory without that read."""
        queries, keep = memory.queries, memory.keep
        own: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        if merge:
            own = (depth_logits(memory.key, queries[..., :1], self.rms_logits)[..., 0], memory.value)
        drop = keep[:1] if keep is not None and self.training else None
        logits, rest_logits = first_row(memory.logits)
        entry_logits = memory.entry_logits
        if len(entry_logits) > 0:  # this read's row of every entry's logits, and the rest for the later reads
            logits = torch.stack([entry[0].expand(memory.logits.shape[2:]) for entry in entry_logits])
            entry_logits = [entry[1:] for entry in entry_logits]
        out = depth_read(logits, memory.values, memory.entries, own, drop, self.num_heads, memory.scratch)
        rest = DepthMemory(queries[..., 1:], None if keep is None else keep[1:], rest_logits, memory.values,
                           memory.scratch, memory.entries, entry_logits, memory.key, memory.value)
        return out.to(queries.dtype), rest

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
    (the reference for the memory's reads, and diagnostics)."""
    logits = [depth_logits(k, queries, rms) for k in keys]
    return torch.stack(torch.broadcast_tensors(*logits), -1).softmax(-1)
