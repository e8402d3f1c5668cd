"""The device of the CUDA tests, and their skip marks.

The tests run on CUDA and are skipped, with the reason, where there is none. ``TIMM_HBF_TEST_DEVICE=cpu`` runs them
on the CPU instead, to rehearse them before GPU time is spent (``benchmarks/gpu_checks.sh --device cpu``): then the
CPU stands in for CUDA, compiling uses the ``aot_eager`` backend, and the tests of CUDA's own kernels are skipped.
"""
import copy
import os
from typing import Iterable, List

import pytest
import torch

DEVICE = os.environ.get('TIMM_HBF_TEST_DEVICE', 'cuda')
REHEARSAL = DEVICE != 'cuda'
COMPILE_BACKEND = 'aot_eager' if REHEARSAL else 'inductor'

needs_device = pytest.mark.skipif(
    not REHEARSAL and not torch.cuda.is_available(),
    reason='CUDA tests: no CUDA device here (TIMM_HBF_TEST_DEVICE=cpu rehearses them on the CPU)')
needs_cuda = pytest.mark.skipif(REHEARSAL, reason="checks CUDA's own kernels: not rehearsed on the CPU")


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float64, on the CPU."""
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def gradients_error(actual: Iterable[torch.Tensor], expected: Iterable[torch.Tensor]) -> float:
    """The relative error of all gradients together, as one vector: no parameter's error hides behind a tiny norm of
    its own, and none with a tiny gradient dominates."""
    actual, expected = list(actual), list(expected)
    assert len(actual) == len(expected) and all(a is not None for a in actual)
    return relative_error(torch.cat([a.flatten().cpu().double() for a in actual]),
                          torch.cat([e.flatten().cpu().double() for e in expected]))


def float64_copy(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` in float64 on the CPU, for the formulas."""
    return copy.deepcopy(module).cpu().double()


def parameter_grads(module: torch.nn.Module) -> List[torch.Tensor]:
    return [p.grad for p in module.parameters()]
