"""Shared test helpers."""
from typing import List

import torch
from torch.overrides import TorchFunctionMode


class ShapeRecorder(TorchFunctionMode):
    """Records the shape of every tensor that torch functions return while active."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: List[torch.Size] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(t.shape)
        return out


def layer_normed(*shape: int, seed: int = 1234) -> torch.Tensor:
    """Random tokens after a LayerNorm without affine, as HyperBF layers see them in a pre-norm block."""
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.layer_norm(torch.randn(*shape, generator=g) * 3 + 1, shape[-1:])


def saved_activation_bytes(module, x):
    """Bytes of the distinct tensors (parameters aside) that autograd keeps for the backward pass of ``module(x)``."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(storages.values())
