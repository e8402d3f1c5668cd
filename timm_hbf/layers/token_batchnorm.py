"""BatchNorm over the last (channel) dimension of token tensors."""
from typing import Optional

import torch
from torch import nn


class TokenBatchNorm(nn.Module):
    """``nn.BatchNorm1d`` for ``(..., C)`` tokens: statistics over every token of the batch, per channel."""

    def __init__(
            self, num_features: int, device: torch.types.Device = None, dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(num_features, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.reshape(-1, x.shape[-1])).view(x.shape)
