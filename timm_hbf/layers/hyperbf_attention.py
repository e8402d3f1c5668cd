"""HyperBF self-attention (CBMM Memo 143, Sec. 2.2.1, Eq. 6): a normalised HyperBF unit whose centres are the keys.

    Attn(q_i) = sum_j softmax_j(-gamma_h ||W (q_i - k_j)||^2) v_j

with one learned width ``gamma_h`` per head (or one per layer, as in the authors' code).
"""
import math
from typing import Optional, Type

import torch
import torch.fx
import torch.nn.functional as F
from timm.layers import maybe_add_mask, resolve_self_attn_mask, use_fused_attn
from torch import nn
from torch.jit import Final

from .._checks import check_count, check_divisor, check_positive
from .hyperbf_kernel import HyperBFKernel, accumulation_dtype

__all__ = ['HyperBFAttention', 'add_self_attn_mask', 'gaussian_sdpa']


def check_one_mask(attn_mask: Optional[torch.Tensor], is_causal: bool) -> None:
    """Refuses ``attn_mask`` together with ``is_causal=True``, as recent ``F.scaled_dot_product_attention`` does (torch
    2.9's returned neither masking) and timm's ``resolve_self_attn_mask`` does not (it drops the mask)."""
    if is_causal and attn_mask is not None:
        raise ValueError('attn_mask and is_causal=True were both given: pass one, or fold the causal mask into '
                         'attn_mask to combine them.')


def add_self_attn_mask(logits: torch.Tensor, attn_mask: Optional[torch.Tensor], is_causal: bool) -> torch.Tensor:
    """``logits (..., N, N)`` with ``attn_mask`` or ``is_causal`` added as the mask that timm's
    ``resolve_self_attn_mask`` makes of them; both at once are refused (:func:`check_one_mask`)."""
    check_one_mask(attn_mask, is_causal)
    return maybe_add_mask(logits, resolve_self_attn_mask(logits.shape[-1], logits, attn_mask, is_causal))


def gaussian_sdpa(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        gamma: torch.Tensor,
        attn_mask: Optional[torch.Tensor] = None,
        dropout_p: float = 0.,
        is_causal: bool = False,
        channel_multiple: int = 8,
) -> torch.Tensor:
    """Gaussian attention ``softmax_j(-gamma ||q_i - k_j||^2) v_j`` on ``F.scaled_dot_product_attention``, with no
    distance matrix outside the kernel: ``q, k, v (B, H, N, D)``, ``gamma (H or 1, 1, 1)``, mask as SDPA takes it.

    Along a softmax over keys the query norm is a constant, so the logits are ``2 gamma q_i . k_j - gamma ||k_j||^2``:
    the dot products ``[q, 1] . [2 gamma k, -gamma ||k||^2]``, with ``v`` zero-padded to the same width (and all three
    to a multiple of ``channel_multiple``: CUDA's flash and cuDNN kernels take half precision only at multiples of 8;
    1 pads nothing; a count >= 1). In half precision the key-norm term is split over two channels, its rounding and
    the remainder, which the kernel's float32 accumulation adds back together: rounded to one bf16 number it would be
    off by up to ``gamma ||k||^2 / 256``. ``attn_mask`` together with ``is_causal=True`` is refused
    (:func:`check_one_mask`).
    """
    check_one_mask(attn_mask, is_causal)
    dim = q.shape[-1]
    k_wide = k.to(accumulation_dtype(k))
    key_term = -gamma * torch.linalg.vecdot(k_wide, k_wide).unsqueeze(-1)  # (B, H, N, 1)
    keys = [(2. * gamma * k).to(k.dtype), key_term.to(k.dtype)]
    if k.dtype == torch.float16 or k.dtype == torch.bfloat16:
        keys.append((key_term - keys[1]).to(k.dtype))
    width = dim + len(keys) - 1  # the head's channels and the key-norm ones
    # zeros up to the multiple, in the one concatenation (no second copy of the keys): q's ones there add nothing
    keys.append(k.new_zeros(list(k.shape[:-1]) + [-width % channel_multiple]))
    k = torch.cat(keys, dim=-1)
    extra = k.shape[-1] - dim
    q = F.pad(q, (0, extra), value=1.)
    v = F.pad(v, (0, extra))
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=1.)
    return out[..., :dim]


# Leaves for torch.fx: their branches read arguments and tensor properties, which a symbolic trace cannot.
torch.fx.wrap('add_self_attn_mask')
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
    ``F.scaled_dot_product_attention`` on the dot-product form of the logits (:func:`gaussian_sdpa`), on every device
    and in every dtype; the reference path computes the distances explicitly, and serves the Laplacian kernel,
    ``TIMM_FUSED_ATTN=0`` and exportable builds.

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
        gamma_init: Initial width, a finite number > 0 (``None``: ``1 / (2 sqrt(head_dim))``).
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
            device: torch.types.Device = None,
            dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        check_count('dim', dim)
        check_count('num_heads', num_heads)
        check_divisor('num_heads', num_heads, 'dim', dim)
        if gamma_init is None:
            gamma_init = 1. / (2. * math.sqrt(dim // num_heads))
        check_positive('gamma_init (the initial attention width; None for 1 / (2 sqrt(head_dim)))', gamma_init)
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
            gamma_init=gamma_init,
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
            attn = add_self_attn_mask(self.kernel.log_kernel(q, k, gamma), attn_mask, is_causal)
            attn = self.attn_drop(attn.softmax(dim=-1))
            x = attn.to(v.dtype) @ v

        x = x.transpose(1, 2).reshape(B, N, C)
        x = self.norm(x)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x
