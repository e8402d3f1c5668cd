"""Diagnostics of attention over depth: Eq. 1's weights computed directly from stored keys, and the report's entropy
metric of a read's weights."""
import math
from typing import List

import torch

from .depth_attention import depth_logits

__all__ = ['depth_weights', 'normalized_entropy']


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
