"""PReLU followed by a Linear layer on token tensors (QIMIA's key and value paths, report Fig. 8-9)."""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ['PReLULinear']


class PReLULinear(nn.Module):
    """``Linear(PReLU(x))`` on ``(..., C)`` tokens, one PReLU slope per channel (``nn.PReLU`` takes channels from dim 1,
    the token dim here), starting at 0.25 as in ``nn.PReLU``. ``fc`` holds the linear map (a LoRA adapter of PEFT or
    a quantised linear layer can take its place)."""

    def __init__(
            self,
            in_features: int,
            out_features: int,
            bias: bool = True,
            slope_init: float = .25,
            device: torch.types.Device = None,
            dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        self.slope_init = slope_init
        self.slope = nn.Parameter(torch.full((in_features,), slope_init, **dd))
        self.fc = nn.Linear(in_features, out_features, bias=bias, **dd)

    def init_weights(self) -> None:
        nn.init.constant_(self.slope, self.slope_init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.prelu(x.reshape(-1, x.shape[-1]), self.slope.to(x.dtype)).view(x.shape))
