"""Learned-query attention over depth (QIMIA, Dugue 2023, report Eq. 1-2).

Every block ``l`` owns a learned query and reads, per token and per head ``h``,

    A_l = Norm( sum_{i<l} softmax_i(q_{l,h} . k_{i,h}) v_{i,h} )          (Eq. 1-2)

over the memory entries ``(k_i, v_i)`` that the embedding and the earlier blocks wrote for that token. Heads split
the key channels and the value channels into ``num_heads`` contiguous groups each. Queries start at zero, so that
at init every read is the uniform average of the entries it sees.

The memory is two preallocated buffers, ``keys (L, B, N, key_width)`` and ``values (L, B, N, dim)``, filled in
place one entry at a time (:func:`write_entry`), which then hold the only copy of every entry: nothing is
concatenated as the network gets deeper. A read (:func:`depth_attend`) of a full memory looks at the filled prefix
of the buffers in place (a block-memory read, of a few summaries, stacks their keys); its hand-written backward pass
saves only the attention weights ``(L, B, N, H)`` and sends gradients to the entries, so a read costs no activation
memory beyond its output. Scripted models are for inference: their writes and reads use plain in-place copies,
without the gradient routing.
"""
import math
from typing import List, Optional, Tuple

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.jit import Final

from .hyperbf_kernel import HyperBFKernel, distance_key

__all__ = [
    'DEPTH_KERNELS', 'DepthAttention', 'DepthKey', 'depth_attend', 'memory_slots', 'normalized_entropy', 'write_entry',
]

DEPTH_KERNELS = ('dot', 'gaussian')


def _accumulation_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 for half types, else the tensor's own dtype."""
    return torch.promote_types(x.dtype, torch.float32)


def _block_diagonal(query: torch.Tensor) -> torch.Tensor:
    """``(H, Dk) -> (H, H * Dk)``: row ``h`` holds ``q_h`` in head ``h``'s key channels and zeros elsewhere, so that
    ``keys @ result.T`` gives every head's logit in one matrix product."""
    heads = query.shape[0]
    eye = torch.eye(heads, dtype=query.dtype, device=query.device)
    return (eye.unsqueeze(-1) * query.unsqueeze(0)).flatten(1)


def _depth_weights(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Softmax over entries of ``q_h . k_{i,h}``: ``(H, Dk), (L, B, N, H * Dk) -> (L, B, N, H)``, in float32 or
    wider."""
    L, B, N, width = keys.shape
    logits = keys.reshape(-1, width).mm(_block_diagonal(query.to(keys.dtype)).t())
    return logits.view(L, B, N, -1).to(_accumulation_dtype(keys)).softmax(0)


def _stacked_keys(keys: torch.Tensor, key_entries: List[torch.Tensor]) -> torch.Tensor:
    """The entries' keys as one ``(L, B, N, Kw)`` tensor: a view of the buffer ``keys`` when they are its first
    ``L`` slots (as in a full memory), else a stack (block-memory reads, or entries that are not slots)."""
    if not torch.jit.is_scripting():  # scripted models (inference) always stack
        if memory_slots(keys, key_entries) == list(range(len(key_entries))):
            return keys[:len(key_entries)]
    return torch.stack([e.expand(keys.shape[1:]).to(keys.dtype) for e in key_entries])


def memory_slots(buffer: torch.Tensor, entries: List[torch.Tensor]) -> List[int]:
    """The slot of ``buffer`` that each entry is (the tensors :func:`write_entry` returns), -1 for any other
    tensor."""
    step = buffer.stride(0) * buffer.element_size()
    slots = []
    for e in entries:
        offset = e.data_ptr() - buffer.data_ptr()
        in_buffer = e.shape == buffer.shape[1:] and offset % step == 0 and 0 <= offset < buffer.shape[0] * step
        slots.append(offset // step if in_buffer else -1)
    return slots


def _mix(weights: torch.Tensor, value_entries: List[torch.Tensor]) -> torch.Tensor:
    """``sum_i w_{i,h} v_{i,h}``: ``(L, B, N, H)`` and ``L`` values ``(B, N, D)`` (or broadcast to it) ``-> (B, N,
    D)``, accumulated entry by entry (no ``(L, B, N, D)`` temporary)."""
    L, B, N, H = weights.shape
    weights = weights.to(value_entries[0].dtype).unsqueeze(-1)
    out = weights[0] * value_entries[0].unflatten(-1, (H, -1))
    for i in range(1, L):
        value = value_entries[i].unflatten(-1, (H, -1))
        out = out.addcmul(weights[i], value) if torch.is_grad_enabled() else out.addcmul_(weights[i], value)
    return out.flatten(-2)


def _layer_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm without affine over the last dim (in float32 under autocast, as ``nn.LayerNorm``)."""
    return F.layer_norm(x, [x.shape[-1]], eps=eps)


def _attend(
        query: torch.Tensor,
        keys: torch.Tensor,
        value_entries: List[torch.Tensor],
        keep: Optional[torch.Tensor],
        norm_eps: float,
) -> torch.Tensor:
    weights = _depth_weights(query, keys)
    if keep is not None:
        weights = weights * keep
    out = _mix(weights, value_entries)
    return _layer_norm(out, norm_eps) if norm_eps > 0. else out


class _DepthAttend(torch.autograd.Function):
    """:func:`_attend` over memory entries. The key buffer is not an autograd input (later blocks keep writing into
    it, after the entries read here); the entries are, and receive the gradients. The norm's backward pass works
    from its output (which the next layer keeps anyway) and ``1 / std``, so the read keeps no copy of the mix before
    the norm."""

    @staticmethod
    def forward(ctx, query, keys, keep, norm_eps, *entries):
        num = len(entries) // 2
        key_entries, value_entries = entries[:num], entries[num:]
        weights = _depth_weights(query, _stacked_keys(keys, key_entries))
        out = _mix(weights * keep if keep is not None else weights, value_entries)
        normed = norm_eps > 0.
        if normed:  # 1 / std in two passes over a cache-sized tensor (torch.var_mean is several times slower here)
            wide = out.to(_accumulation_dtype(out))
            centered = wide - wide.mean(-1, keepdim=True)
            rstd = (centered.square().mean(-1, keepdim=True) + norm_eps).rsqrt()
            out = _layer_norm(out, norm_eps)
        ctx.keys, ctx.entries, ctx.has_keep, ctx.normed = keys, entries, keep is not None, normed
        ctx.save_for_backward(weights, query, *([keep] if keep is not None else []), *([out, rstd] if normed else []))
        return out

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors  # unpacked once: grad checkpointing allows no second unpack
        weights, query = saved[:2]
        keep = saved[2] if ctx.has_keep else None
        if ctx.normed:  # LayerNorm backward from y and 1 / std: rstd (g - mean(g) - y mean(g y))
            normed_out, rstd = saved[-2:]
            normed_out, grad = normed_out.to(rstd.dtype), grad.to(rstd.dtype)
            grad = rstd * (grad - grad.mean(-1, keepdim=True) - normed_out * (grad * normed_out).mean(-1, keepdim=True))
        L, B, N, H = weights.shape
        key_entries, value_entries = ctx.entries[:L], ctx.entries[L:]
        keys = _stacked_keys(ctx.keys, key_entries)
        grad = grad.view(B, N, H, -1)
        used = (weights * keep if keep is not None else weights).to(grad.dtype).unsqueeze(-1)
        grad_values = [(used[i] * grad).flatten(-2) for i in range(L)]
        grad_used = weights.new_empty(weights.shape)
        for i in range(L):
            grad_used[i] = (value_entries[i].unflatten(-1, (H, -1)) * grad).sum(-1, dtype=weights.dtype)
        grad_weights = grad_used * keep if keep is not None else grad_used
        grad_logits = weights * (grad_weights - (weights * grad_weights).sum(0, keepdim=True))  # softmax backward
        grad_logits = grad_logits.to(keys.dtype).view(L, B * N, H)
        # as in the forward pass, heads go through block-diagonal matrix products
        grad_query = grad_logits.view(-1, H).t().mm(keys.view(-1, keys.shape[-1]))  # (H, H * Dk): blocks h, h
        grad_query = grad_query.view(H, H, -1).diagonal(dim1=0, dim2=1).t().to(query.dtype)
        query_blocks = _block_diagonal(query.to(keys.dtype))
        grad_keys = [grad_logits[i].mm(query_blocks).view(B, N, -1) for i in range(L)]
        grads = [g.sum_to_size(e.shape).to(e.dtype) for g, e in zip(grad_keys + grad_values, ctx.entries)]
        return (grad_query, None, None, None, *grads)


def depth_attend(
        query: torch.Tensor,
        keys: torch.Tensor,
        key_entries: List[torch.Tensor],
        value_entries: List[torch.Tensor],
        keep: Optional[torch.Tensor] = None,
        norm_eps: float = 0.,
) -> torch.Tensor:
    """Attention of ``query (H, Dk)`` over the memory entries ``key_entries[i] (B, N, Kw)``, ``value_entries[i] (B,
    N, D)`` (Eq. 1-2): ``(B, N, D)``. When the entries are the first slots of the key buffer ``keys`` (what
    :func:`write_entry` returns), their keys are read in place. ``keep`` (``(L, B, N, H)``, optional) scales the
    weights, e.g. a dropout mask; ``norm_eps > 0`` applies LayerNorm without affine, with that epsilon."""
    if torch.jit.is_scripting() or not torch.is_grad_enabled():
        return _attend(query, _stacked_keys(keys, key_entries), value_entries, keep, norm_eps)
    return _DepthAttend.apply(query, keys, keep, norm_eps, *key_entries, *value_entries)


class _WriteEntry(torch.autograd.Function):
    """``buffer[index] = entry``, returning the stored slot as the entry from now on: the caller's tensor can be
    freed, the memory holds the only copy, and gradients reaching the slot go to ``entry``. The slot tensor gets a
    version counter of its own, so that later writes to other slots don't invalidate it."""

    @staticmethod
    def forward(ctx, buffer, index, entry):
        slot = buffer[index]
        slot.copy_(entry)
        ctx.entry_shape = entry.shape
        return slot.new_empty(0).set_(slot.untyped_storage(), slot.storage_offset(), slot.shape, slot.stride())

    @staticmethod
    def backward(ctx, grad):
        return None, None, grad.sum_to_size(ctx.entry_shape)


def write_entry(
        keys: torch.Tensor,
        values: torch.Tensor,
        index: int,
        key: torch.Tensor,
        value: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Store entry ``index`` in the buffers (``key (.., N, Kw)`` and ``value (.., N, D)`` broadcast over the batch)
    and return the stored ``(key, value)``, which stand for the entry from then on (they share the buffers' memory
    and pass gradients on to the tensors given)."""
    if torch.jit.is_scripting() or not torch.is_grad_enabled():
        keys[index].copy_(key)
        values[index].copy_(value)
        return keys[index], values[index]
    return _WriteEntry.apply(keys, index, key), _WriteEntry.apply(values, index, value)


# Leaves for torch.fx, so that traced models keep the in-place writes and the custom backward.
torch.fx.wrap('depth_attend')
torch.fx.wrap('write_entry')


def normalized_entropy(weights: torch.Tensor) -> torch.Tensor:
    """Entropy of attention weights over entries (dim 0), divided by ``log(L)``: 1 for a uniform average (what a
    residual stream computes), 0 for a single entry. The report's entropy metric, averaged over all other dims."""
    entropy = -(weights * weights.clamp_min(1e-30).log()).sum(0).mean()
    num = weights.shape[0]
    return entropy / math.log(num) if num > 1 else torch.zeros_like(entropy)


class DepthKey(nn.Module):
    """Puts a block's key ``(B, N, key_dim)`` into the form the memory stores: optionally unit L2 per head (the
    report's key normalisation), and ``[k_h, ||k_h||^2]`` per head for Gaussian depth attention (see
    :func:`~timm_hbf.layers.hyperbf_kernel.distance_key`)."""
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
            k = nn.functional.normalize(k, dim=-1)
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
            ``-gamma ||q - k||^2``, the report's L2 attention, with the HyperBF kernel and one width per head).
        norm: LayerNorm (without affine) on the result.
        path_drop: Dropout on the attention weights (the report's path dropout).
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
        return self.kernel.distance_query(self.query)

    def weights(self, keys: torch.Tensor, key_entries: List[torch.Tensor]) -> torch.Tensor:
        """Attention weights ``(len(key_entries), B, N, H)`` over the entries (see :func:`depth_attend`)."""
        return _depth_weights(self.operand(), _stacked_keys(keys, key_entries))

    def forward(
            self,
            keys: torch.Tensor,
            key_entries: List[torch.Tensor],
            value_entries: List[torch.Tensor],
    ) -> torch.Tensor:
        keep: Optional[torch.Tensor] = None
        if self.training and self.path_drop > 0.:
            shape: Tuple[int, int, int, int] = (len(key_entries), keys.shape[1], keys.shape[2], self.num_heads)
            keep = torch.empty(shape, device=keys.device).bernoulli_(1. - self.path_drop) / (1. - self.path_drop)
        return depth_attend(self.operand(), keys, key_entries, value_entries, keep, self.norm_eps)

    def extra_repr(self) -> str:
        return f'num_heads={self.num_heads}, norm_eps={self.norm_eps}, path_drop={self.path_drop}'
