"""Attention Residuals' block (Kimi Team, 2026): timm's pre-norm ViT block whose residual adds are reads and writes of
the depth memory (:mod:`.depth_attention`)."""
from typing import List, Optional

import torch
from timm.layers import Attention, LayerNorm, LayerScale, Mlp
from torch import nn

from .depth_attention import DepthAttention, DepthMemory
from .prelu import PReLULinear
from .token_batchnorm import TokenBatchNorm

__all__ = ['AttnResBlock']


class AttnResBlock(nn.Module):
    """timm's pre-norm ViT block whose residual adds are reads and writes of the depth memory (AttnRes Eq. 2-4):

        x = read1(memory)    memory = write1(memory, ls1(attn(norm1(x))))
        x = read2(memory)    memory = write2(memory, ls2(mlp(norm2(x))))

    The sublayers carry timm's ``Block`` names (layer scale with ``init_values``), so that a timm ViT's weights load.
    Keys come from the written values, or from a learned key path (``key1``, ``key2``) on the sublayer's output;
    ``value_norm1``, ``value_norm2`` act on the written values.
    """

    def __init__(
            self,
            dim: int,
            num_heads: int,
            read1: DepthAttention,
            read2: DepthAttention,
            mlp_ratio: float = 4.,
            qkv_bias: bool = True,
            qk_norm: bool = False,
            proj_drop: float = 0.,
            attn_drop: float = 0.,
            init_values: Optional[float] = None,
            key_dim: Optional[int] = None,
            batchnorm: bool = False,
            device: torch.types.Device = None,
            dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        self.read1 = read1
        self.norm1 = nn.LayerNorm(dim, eps=1e-6, **dd)
        self.attn = Attention(dim, num_heads=num_heads, qkv_bias=qkv_bias, qk_norm=qk_norm, attn_drop=attn_drop,
                              proj_drop=proj_drop, norm_layer=LayerNorm, **dd)
        self.ls1 = LayerScale(dim, init_values, **dd) if init_values else nn.Identity()
        self.key1 = PReLULinear(dim, key_dim, **dd) if key_dim else None
        self.value_norm1 = TokenBatchNorm(dim, **dd) if batchnorm else nn.Identity()
        self.read2 = read2
        self.norm2 = nn.LayerNorm(dim, eps=1e-6, **dd)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=proj_drop, **dd)
        self.ls2 = LayerScale(dim, init_values, **dd) if init_values else nn.Identity()
        self.key2 = PReLULinear(dim, key_dim, **dd) if key_dim else None
        self.value_norm2 = TokenBatchNorm(dim, **dd) if batchnorm else nn.Identity()

    def memory_queries(self) -> List[torch.Tensor]:
        """The queries of its reads, in reading order."""
        return self.read1.memory_queries() + self.read2.memory_queries()

    def forward(
            self,
            memory: DepthMemory,
            attn_mask: Optional[torch.Tensor] = None,
            is_causal: bool = False,
    ) -> DepthMemory:
        x, memory = self.read1(memory)
        h = self.ls1(self.attn(self.norm1(x), attn_mask=attn_mask, is_causal=is_causal))
        memory = self.read1.write(memory, None if self.key1 is None else self.key1(h), self.value_norm1(h))
        x, memory = self.read2(memory)
        h = self.ls2(self.mlp(self.norm2(x)))
        return self.read2.write(memory, None if self.key2 is None else self.key2(h), self.value_norm2(h))
