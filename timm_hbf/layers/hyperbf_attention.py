"""HyperBF self-attention (CBMM Memo 143, Sec. 2.2.1, Eq. 6): a normalised HyperBF unit whose centres are the keys.

    Attn(q_i) = sum_j softmax_j(-gamma_h ||W (q_i - k_j)||^2) v_j

with one learned width ``gamma_h`` per head (or one per layer, as in the authors' code).
"""
import math

import torch
from timm.layers import use_fused_attn
from torch import nn
from torch.jit import Final

from .hyperbf_kernel import HyperBFKernel

__all__ = ['HyperBFAttention']


class HyperBFAttention(nn.Module):
    """Multi-head attention with Gaussian (or Laplacian) kernel logits instead of scaled dot products.

    ``gamma`` starts at ``1 / (2 sqrt(head_dim))``: the query-key term of ``-gamma ||q - k||^2`` is then
    ``q . k / sqrt(head_dim)``, so at init the logits have the scale of standard scaled dot-product attention
    (up to the key-norm bias, which the softmax does not ignore).

    The fused path (Gaussian kernel, ``timm.layers.use_fused_attn()``) builds no distance matrix: through
    :meth:`HyperBFKernel.dot_product_attention`, ``F.scaled_dot_product_attention`` runs on queries and keys augmented
    with one channel that carries the key-norm term, padded with ``v`` to a head width the fused kernels accept (a
    multiple of 8 on CUDA); CPU inference passes that term as a mask and reads the projection's own q, k and v (its
    queries scaled in place); CPU training of sequences up to four times the head width (65 tokens at 32x32 with
    patch 4, 197 at 224x224 with patch 16) writes each head's weights out with batched matrix products, which is
    faster there (see :func:`~timm_hbf.layers.hyperbf_kernel.explicit_weights_pay`). The
    reference path computes the distances explicitly; it serves the Laplacian kernel, ``TIMM_FUSED_ATTN=0`` and
    exportable builds.

    Args:
        dim: Token dimension.
        num_heads: Number of heads; must divide ``dim``.
        qkv_bias: Bias on the q, k, v projection.
        gamma_per_head: One width per head (default) or one shared by all heads of the layer.
        kernel: ``'gaussian'`` or ``'laplacian'``.
        mahalanobis: Learn a metric ``W^T W`` over each head's q/k space (shared by the heads).
        attn_drop: Dropout on the attention weights.
        proj_drop: Dropout after the output projection.
    """
    fused_attn: Final[bool]

    def __init__(
            self,
            dim: int,
            num_heads: int = 8,
            qkv_bias: bool = False,
            gamma_per_head: bool = True,
            kernel: str = 'gaussian',
            mahalanobis: bool = False,
            attn_drop: float = 0.,
            proj_drop: float = 0.,
            device=None,
            dtype=None,
    ) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f'dim ({dim}) must be divisible by num_heads ({num_heads}).')
        dd = {'device': device, 'dtype': dtype}
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias, **dd)
        self.kernel = HyperBFKernel(
            self.head_dim,
            num_widths=num_heads if gamma_per_head else 1,
            gamma_init=1. / (2. * math.sqrt(self.head_dim)),
            kernel=kernel,
            mahalanobis=mahalanobis,
            **dd,
        )
        self.fused_attn = use_fused_attn() and self.kernel.is_gaussian
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim, **dd)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim)
        if self.kernel.metric is not None:
            qkv = torch.cat([self.kernel.project(qkv[:, :, :2]), qkv[:, :, 2:]], dim=2)
        gamma = self.kernel.gamma()

        if self.fused_attn:
            x = self.kernel.dot_product_attention(
                qkv, gamma, dropout_p=self.attn_drop.p if self.training else 0., inplace=True)
        else:
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
            attn = self.kernel.log_kernel(q, k, gamma.reshape(-1, 1, 1)).softmax(dim=-1)
            attn = self.attn_drop(attn)
            x = attn.to(v.dtype) @ v

        x = x.transpose(1, 2).reshape(B, N, C)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x
