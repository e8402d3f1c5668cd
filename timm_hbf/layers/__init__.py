from .hyperbf_attention import HyperBFAttention
from .hyperbf_kernel import KERNELS, HyperBFKernel, pairwise_sq_dist
from .hyperbf_mlp import HyperBFMlp

__all__ = ['HyperBFAttention', 'HyperBFKernel', 'HyperBFMlp', 'KERNELS', 'pairwise_sq_dist']
