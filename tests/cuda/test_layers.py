"""HyperBF attention and the HyperBF MLP on CUDA against their formulas computed in float64 on the CPU: both paths of
the attention (the fused one with gradients and without, the reference with explicit distances) and the MLP, in float32
and under bf16 autocast, forward and backward; the fused path under each of CUDA's SDPA kernels."""
import pytest
import torch

from timm_hbf.layers import HyperBFAttention, HyperBFMlp

from ..helpers import layer_normed
from ..layers.test_hyperbf_attention import explicit_attention
from .device import (
    DEVICE,
    float64_copy,
    gradients_error,
    needs_cuda,
    needs_device,
    parameter_grads,
    relative_error,
)

pytestmark = needs_device

# largest relative error (norm-wise) against the float64 formula, output then all gradients together. float32: TF32
# matrix products, were they on, would stay below it (a wrong path is off by order 1); bf16 autocast: 2 to 3 times what
# both attention paths and the MLP gave on the CPU (at most 0.008 and 0.028)
TOLERANCE = {'float32': (1e-3, 1e-3), 'bfloat16': (2e-2, 6e-2)}
# (width, heads, tokens): a head width of 64 at 32x32 / patch 4 (65 tokens) and 48 at 224 / patch 16 (197 tokens)
SHAPES = [(192, 3, 65), (96, 2, 197)]
SHAPE_IDS = ['64wide_65tokens', '48wide_197tokens']


def mlp_formula(mlp: HyperBFMlp, x: torch.Tensor) -> torch.Tensor:
    """``readout(exp(-gamma_i ||x - t_i||^2))`` (softmax over the centres when normalised; ``mlp`` in float64)."""
    log_k = -mlp.kernel.gamma() * torch.cdist(x, mlp.centers.expand(x.shape[0], -1, -1)).square()
    return mlp.readout(log_k.softmax(-1) if mlp.normalized else log_k.exp())


def attention_layer(width: int, heads: int) -> HyperBFAttention:
    """A layer with widths away from their init, one per head."""
    torch.manual_seed(0)
    layer = HyperBFAttention(width, num_heads=heads, qkv_bias=True)
    with torch.no_grad():
        layer.kernel.log_gamma.copy_(layer.kernel.log_gamma + torch.linspace(-.5, .5, heads))
    return layer


def run(module: torch.nn.Module, x: torch.Tensor, dtype: str, grad: bool):
    """``module`` on DEVICE: its output and, with ``grad``, the gradients of input and parameters for a fixed output
    gradient (``None`` without)."""
    module = module.to(DEVICE)
    module.zero_grad(set_to_none=True)
    x = x.to(DEVICE).requires_grad_(grad)
    with torch.set_grad_enabled(grad), torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=dtype == 'bfloat16'):
        out = module(x)
    if not grad:
        return out, None
    out.backward(output_gradient(out).to(out.dtype))
    return out, [x.grad, *parameter_grads(module)]


def output_gradient(out: torch.Tensor) -> torch.Tensor:
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(out.device)


def check_against(module: torch.nn.Module, formula, x: torch.Tensor, dtype: str, grad: bool) -> None:
    exact_module = float64_copy(module)
    exact_x = x.double().requires_grad_()
    exact = formula(exact_module, exact_x)
    exact.backward(output_gradient(exact).cpu())
    out, grads = run(module, x, dtype, grad)
    assert out.dtype == (torch.bfloat16 if dtype == 'bfloat16' else torch.float32)
    out_tolerance, grad_tolerance = TOLERANCE[dtype]
    assert relative_error(out, exact) < out_tolerance
    if grad:
        assert gradients_error(grads, [exact_x.grad, *parameter_grads(exact_module)]) < grad_tolerance


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
@pytest.mark.parametrize('path, grad', [('fused', True), ('fused', False), ('reference', True), ('reference', False)],
                         ids=['fused_training', 'fused_inference', 'reference_training', 'reference_inference'])
@pytest.mark.parametrize('width, heads, tokens', SHAPES, ids=SHAPE_IDS)
def test_attention_computes_the_formula(width, heads, tokens, path, grad, dtype):
    layer = attention_layer(width, heads)
    layer.fused_attn = path == 'fused'
    check_against(layer, explicit_attention, layer_normed(4, tokens, width) * 2, dtype, grad)


@needs_cuda
@pytest.mark.parametrize('dtype, backend', [
    ('float32', 'EFFICIENT_ATTENTION'), ('float32', 'MATH'), ('bfloat16', 'FLASH_ATTENTION'),
    ('bfloat16', 'CUDNN_ATTENTION'), ('bfloat16', 'EFFICIENT_ATTENTION'), ('bfloat16', 'MATH'),
])
def test_fused_attention_computes_the_formula_on_every_sdpa_kernel(dtype, backend):
    """Flash and cuDNN kernels take half precision only, at head widths that are multiples of 8; each must run the
    fused path's padded width (72 for a head width of 64), forward and backward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    layer = attention_layer(192, 3)
    with sdpa_kernel([getattr(SDPBackend, backend)]):
        check_against(layer, explicit_attention, layer_normed(4, 65, 192) * 2, dtype, grad=True)


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
@pytest.mark.parametrize('grad', [True, False], ids=['training', 'inference'])
@pytest.mark.parametrize('normalized', [False, True], ids=['units', 'normalized'])
def test_mlp_computes_the_formula(normalized, grad, dtype):
    torch.manual_seed(0)
    mlp = HyperBFMlp(192, 768, normalized=normalized)
    check_against(mlp, mlp_formula, layer_normed(4, 65, 192), dtype, grad)
