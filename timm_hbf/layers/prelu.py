"""PReLU over the last (channel) dimension of token tensors."""
import torch
import torch.nn.functional as F
from torch import nn


class TokenPReLU(nn.Module):
    """``max(x, 0) + a_c min(x, 0)`` with one learned slope per channel of ``(..., C)`` tokens (``nn.PReLU``
    takes channels from dim 1, which is the token dim here). Slopes start at 0.25, as in ``nn.PReLU``."""

    def __init__(self, num_channels: int, init: float = .25, device=None, dtype=None) -> None:
        super().__init__()
        self.init = init
        self.weight = nn.Parameter(torch.full((num_channels,), init, device=device, dtype=dtype))

    def init_weights(self) -> None:
        nn.init.constant_(self.weight, self.init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.prelu(x.reshape(-1, x.shape[-1]), self.weight.to(x.dtype)).view(x.shape)

    def extra_repr(self) -> str:
        return f'num_channels={self.weight.numel()}'
