from .attnres_block import AttnResBlock
from .depth_attention import (
    DEPTH_KERNELS,
    DepthAttention,
    DepthMemory,
    depth_logits,
    depth_read,
)
from .depth_diagnostics import depth_weights, normalized_entropy
from .hyperbf_attention import HyperBFAttention
from .hyperbf_kernel import KERNELS, HyperBFKernel, log_gaussian
from .hyperbf_mlp import HyperBFMlp
from .prelu import PReLULinear
from .token_batchnorm import TokenBatchNorm

__all__ = [
    'AttnResBlock', 'DEPTH_KERNELS', 'DepthAttention', 'DepthMemory', 'HyperBFAttention', 'HyperBFKernel', 'HyperBFMlp',
    'KERNELS', 'PReLULinear', 'TokenBatchNorm', 'depth_logits', 'depth_read', 'depth_weights', 'log_gaussian',
    'normalized_entropy',
]
