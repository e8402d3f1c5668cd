"""HyperBF self-attention (CBMM Memo 143, Sec. 2.2.1, Eq. 6): a normalised HyperBF unit whose centres are the keys.

    Attn(q_i) = sum_j softmax_j(-gamma_h ||W (q_i - k_j)||^2) v_j

with one learned width ``gamma_h`` per head (or one per layer, as in the authors' code).
"""
import math
from typing import Optional, Type

import torch
import torch.fx
import torch.nn.functional as F
from timm.layers import use_fused_attn
from torch import nn
from torch.jit import Final

from .hyperbf_kernel import HyperBFKernel

__all__ = ['HyperBFAttention', 'additive_mask', 'gaussian_sdpa']


def additive_mask(
        attn_mask: Optional[torch.Tensor],
        is_causal: bool,
        num_queries: int,
        num_keys: int,
        like: torch.Tensor,
) -> Optional[torch.Tensor]:
    """``attn_mask`` and ``is_causal`` as ``F.scaled_dot_product_attention`` reads them, turned into one additive
    mask in the dtype of ``like`` (``None`` for none): a boolean mask marks with True what may be attended to, a float
    mask is added to the logits, and causal masking hides the keys after each query's position."""
    mask: Optional[torch.Tensor] = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            mask = torch.zeros(attn_mask.shape, dtype=like.dtype, device=like.device).masked_fill(
                attn_mask.logical_not(), float('-inf'))
        else:
            mask = attn_mask.to(like.dtype)
    if is_causal:
        causal = torch.ones(num_queries, num_keys, dtype=torch.bool, device=like.device).tril()
        causal = torch.zeros(causal.shape, dtype=like.dtype, device=like.device).masked_fill(
            causal.logical_not(), float('-inf'))
        mask = causal if mask is None else mask + causal
    return mask


def _is_half(x: torch.Tensor) -> bool:
    return x.dtype == torch.float16 or x.dtype == torch.bfloat16


def gaussian_sdpa(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        gamma: torch.Tensor,
        attn_mask: Optional[torch.Tensor] = None,
        dropout_p: float = 0.,
        is_causal: bool = False,
) -> torch.Tensor:
    """Gaussian attention ``softmax_j(-gamma ||q_i - k_j||^2) v_j`` on ``F.scaled_dot_product_attention``, with no
    distance matrix outside the kernel: ``q, k, v (B, H, N, D)``, ``gamma (H or 1, 1, 1)``, mask as SDPA takes it.

    Along a softmax over keys the query norm is a constant, so the logits are ``2 gamma q_i . k_j - gamma ||k_j||^2``:
    a dot product plus a row that depends on the key alone. Two ways to give SDPA that row, by what it can do:

    * extra channels, ``[q, 1] . [2 gamma k, -gamma ||k||^2]``, with ``v`` zero-padded to the same width (a
      multiple of 8 on CUDA, as its flash kernels want). In half precision the key-norm term is split over two
      channels, its rounding and the remainder, which the kernel's float32 accumulation adds back together: rounded
      to one bf16 number it would be off by up to ``gamma ||k||^2 / 256``.
    * for CPU inference in float32: an additive mask row on the queries scaled by ``2 gamma``, which torch's CPU flash
      kernel takes at the head width of ``q`` (it has no backward pass for masks, and autocast would round the mask
      to bf16).
    """
    num_keys, dim = k.shape[-2], k.shape[-1]
    wide = torch.promote_types(k.dtype, torch.float32)
    k_wide = k.to(wide)
    key_term = -gamma * torch.linalg.vecdot(k_wide, k_wide).unsqueeze(-1)  # (B, H, N, 1)
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                              or gamma.requires_grad)
    if needs_grad or q.is_cuda or _is_half(q):
        key_channels = [key_term.to(k.dtype)]
        if _is_half(k):
            key_channels.append((key_term - key_channels[0].to(wide)).to(k.dtype))
        width = dim + len(key_channels)
        pad = (-width % 8) if q.is_cuda else 0  # q's extra channels are all 1: only those facing key terms count
        extra = k.shape[:-1] + (width + pad - dim,)
        if pad:
            key_channels.append(k.new_zeros(()).expand(k.shape[:-1] + (pad,)))
        q = torch.cat([q, q.new_ones(()).expand(extra)], dim=-1)
        k = torch.cat([(2. * gamma * k).to(k.dtype)] + key_channels, dim=-1)
        v = torch.cat([v, v.new_zeros(()).expand(extra)], dim=-1)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=1.)
        return out[..., :dim]
    mask = key_term.transpose(-1, -2)  # (B, H, 1, N)
    extra = additive_mask(attn_mask, is_causal, q.shape[-2], num_keys, mask)
    if extra is not None:
        mask = mask + extra
    return F.scaled_dot_product_attention(
        (2. * gamma * q).to(q.dtype), k, v, attn_mask=mask, dropout_p=dropout_p, scale=1.)


# Leaves for torch.fx: their branches read tensor properties, which a symbolic trace cannot.
torch.fx.wrap('additive_mask')
torch.fx.wrap('gaussian_sdpa')


class HyperBFAttention(nn.Module):
    """Multi-head attention with Gaussian (or Laplacian) kernel logits instead of scaled dot products.

    Takes the arguments timm's ViT ``Block`` passes to its attention layer (``qk_norm``, ``scale_norm``,
    ``proj_bias``, ``norm_layer``, ...) and, in ``forward``, an additive or boolean ``attn_mask`` and ``is_causal``
    with the meaning they have for ``F.scaled_dot_product_attention``.

    ``gamma`` starts at ``1 / (2 sqrt(head_dim))``: the query-key term of ``-gamma ||q - k||^2`` is then
    ``q . k / sqrt(head_dim)``, so at init the logits have the scale of standard scaled dot-product attention (up to
    the key-norm term, which the softmax does not ignore).

    Two paths, as in timm's ``Attention``: the fused path (Gaussian kernel, ``timm.layers.use_fused_attn()``) runs
    ``F.scaled_dot_product_attention`` on the dot-product form of the logits (:func:`gaussian_sdpa`); the reference
    path computes the distances explicitly, and serves the Laplacian kernel, ``TIMM_FUSED_ATTN=0`` and exportable
    builds.

    Args:
        dim: Token dimension.
        num_heads: Number of heads; must divide ``dim``.
        qkv_bias: Bias on the q, k, v projection.
        qk_norm: Normalise queries and keys per head (with ``norm_layer``) before their distances are taken.
        scale_norm: Normalise the attention output (with ``norm_layer``) before the output projection.
        proj_bias: Bias on the output projection.
        attn_drop: Dropout on the attention weights.
        proj_drop: Dropout after the output projection.
        norm_layer: Norm for ``qk_norm`` and ``scale_norm``.
        kernel: ``'gaussian'`` or ``'laplacian'``.
        mahalanobis: Learn a metric ``W^T W`` over each head's q/k space (shared by the heads).
        gamma_per_head: One width per head (default) or one shared by all heads of the layer.
        gamma_init: Initial width (default ``1 / (2 sqrt(head_dim))``).
    """
    fused_attn: Final[bool]

    def __init__(
            self,
            dim: int,
            num_heads: int = 8,
            qkv_bias: bool = False,
            qk_norm: bool = False,
            scale_norm: bool = False,
            proj_bias: bool = True,
            attn_drop: float = 0.,
            proj_drop: float = 0.,
            norm_layer: Optional[Type[nn.Module]] = None,
            kernel: str = 'gaussian',
            mahalanobis: bool = False,
            gamma_per_head: bool = True,
            gamma_init: Optional[float] = None,
            device=None,
            dtype=None,
    ) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f'dim ({dim}) must be divisible by num_heads ({num_heads}).')
        if (qk_norm or scale_norm) and norm_layer is None:
            raise ValueError('qk_norm and scale_norm need a norm_layer.')
        dd = {'device': device, 'dtype': dtype}
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias, **dd)
        self.q_norm = norm_layer(self.head_dim, **dd) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(self.head_dim, **dd) if qk_norm else nn.Identity()
        self.kernel = HyperBFKernel(
            self.head_dim,
            num_widths=num_heads if gamma_per_head else 1,
            gamma_init=gamma_init or 1. / (2. * math.sqrt(self.head_dim)),
            kernel=kernel,
            mahalanobis=mahalanobis,
            **dd,
        )
        self.fused_attn = use_fused_attn() and self.kernel.is_gaussian
        self.attn_drop = nn.Dropout(attn_drop)
        self.norm = norm_layer(dim, **dd) if scale_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim, bias=proj_bias, **dd)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(
            self,
            x: torch.Tensor,
            attn_mask: Optional[torch.Tensor] = None,
            is_causal: bool = False,
    ) -> torch.Tensor:
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.kernel.project(self.q_norm(q)), self.kernel.project(self.k_norm(k))
        gamma = self.kernel.gamma().view(-1, 1, 1)

        if self.fused_attn:
            x = gaussian_sdpa(
                q, k, v, gamma, attn_mask=attn_mask, dropout_p=self.attn_drop.p if self.training else 0.,
                is_causal=is_causal,
            )
        else:
            attn = self.kernel.log_kernel(q, k, gamma)
            mask = additive_mask(attn_mask, is_causal, N, N, attn)
            if mask is not None:
                attn = attn + mask
            attn = self.attn_drop(attn.softmax(dim=-1))
            x = attn.to(v.dtype) @ v

        x = x.transpose(1, 2).reshape(B, N, C)
        x = self.norm(x)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x
