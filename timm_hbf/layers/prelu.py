"""PReLU followed by a Linear layer on token tensors (QIMIA's key and value paths, report Fig. 8-9), with the PReLU
recomputed in the backward pass."""
from typing import Optional

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

__all__ = ['PReLULinear']


class _PReLULinear(torch.autograd.Function):
    """``linear(prelu(x, slope), weight, bias)`` over ``(M, C)`` rows that saves ``x`` (which the layer before keeps
    anyway) and not the PReLU output, which autograd's PReLU and Linear would both keep.

    The backward pass recomputes the PReLU as ``x + (slope - 1) min(x, 0)``, deliberately not as the forward's
    ``F.prelu``: under ``torch.compile`` two identical expressions would be merged into one, and the partitioner
    would then keep the forward's PReLU output for the backward pass instead of recomputing it."""

    @staticmethod
    def forward(ctx, x, slope, weight, bias):
        out = F.linear(F.prelu(x, slope), weight, bias)  # under autocast: in the autocast dtype
        ctx.save_for_backward(x, slope, weight)
        ctx.compute_dtype, ctx.input_dtype, ctx.has_bias = out.dtype, x.dtype, bias is not None
        return out

    @staticmethod
    def backward(ctx, grad):
        x, slope, weight = ctx.saved_tensors
        dtype = ctx.compute_dtype
        x, slope_c, weight_c, grad = x.to(dtype), slope.to(dtype), weight.to(dtype), grad.to(dtype)
        # two tensors of x's size at a time: min(x, 0), reused for the terms of the slope's and x's gradients, and the
        # recomputed PReLU output, then the gradient of x
        slope_m1 = slope_c - 1
        negative = torch.clamp_max(x, 0)
        grad_weight = grad.t().mm(torch.addcmul(x, negative, slope_m1))  # the PReLU output x + (slope - 1) min(x, 0)
        grad_bias = grad.sum(0) if ctx.has_bias else None
        grad_x = grad.mm(weight_c)
        grad_slope = negative.mul_(grad_x).sum(0)  # sum of grad * min(x, 0)
        grad_x.mul_(negative.copy_(x).lt_(0).mul_(slope_m1).add_(1))  # d/dx: the slope where x < 0, else 1
        return (grad_x.to(ctx.input_dtype), grad_slope.to(slope.dtype), grad_weight.to(weight.dtype),
                grad_bias.to(weight.dtype) if grad_bias is not None else None)


def prelu_linear(
        x: torch.Tensor,
        slope: torch.Tensor,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
) -> torch.Tensor:
    """``Linear(PReLU(x))`` over the last dim of ``x (..., C)``, with a per-channel PReLU ``slope (C,)``."""
    rows = x.reshape(-1, x.shape[-1])
    if torch.jit.is_scripting() or not torch.is_grad_enabled():
        out = F.linear(F.prelu(rows, slope.to(rows.dtype)), weight, bias)
    else:
        out = _PReLULinear.apply(rows, slope.to(rows.dtype), weight, bias)
    return out.view(x.shape[:-1] + (out.shape[-1],))


torch.fx.wrap('prelu_linear')  # a leaf for torch.fx, which cannot trace into an autograd Function


class PReLULinear(nn.Module):
    """``Linear(PReLU(x))`` on ``(..., C)`` tokens, one PReLU slope per channel (``nn.PReLU`` takes channels from dim 1,
    the token dim here), starting at 0.25 as in ``nn.PReLU``. ``fc`` holds the linear map; a module put in its place
    (a LoRA adapter of PEFT, a quantised linear layer) is called on the PReLU output, without the recomputation."""

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
        if not torch.jit.is_scripting():
            if type(self.fc) is not nn.Linear:
                return self.fc(F.prelu(x.reshape(-1, x.shape[-1]), self.slope.to(x.dtype)).view(x.shape))
        return prelu_linear(x, self.slope, self.fc.weight, self.fc.bias)
