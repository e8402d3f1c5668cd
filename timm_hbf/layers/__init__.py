from .depth_attention import (
    DEPTH_KERNELS,
    DepthAttention,
    DepthKey,
    depth_attend,
    memory_slots,
    normalized_entropy,
    write_entry,
)
from .hyperbf_attention import HyperBFAttention
from .hyperbf_kernel import KERNELS, HyperBFKernel, pairwise_sq_dist
from .hyperbf_mlp import HyperBFMlp
from .prelu import PReLULinear, prelu_linear
from .token_batchnorm import TokenBatchNorm

__all__ = [
    'DEPTH_KERNELS', 'DepthAttention', 'DepthKey', 'HyperBFAttention', 'HyperBFKernel', 'HyperBFMlp', 'KERNELS',
    'PReLULinear', 'TokenBatchNorm', 'depth_attend', 'memory_slots', 'normalized_entropy', 'pairwise_sq_dist',
    'prelu_linear', 'write_entry',
]
