"""PReLU + Linear with the PReLU recomputed in the backward pass: the function and gradients of a per-channel PReLU
followed by ``nn.Linear``, without keeping the PReLU output."""
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers import saved_activation_bytes
from timm_hbf.layers import PReLULinear
from timm_hbf.layers.prelu import prelu_linear


def layer_and_input(dtype=torch.float32, bias=True, seed=0):
    torch.manual_seed(seed)
    layer = PReLULinear(16, 8, bias=bias).to(dtype)
    with torch.no_grad():
        layer.slope.uniform_(-.5, 1.5)  # distinct per channel, negative ones included
    x = torch.randn(2, 5, 16, dtype=dtype, requires_grad=True)
    return layer, x


def plain(layer, x):
    """PReLU over the channel (last) dim, then Linear, with plain autograd."""
    return F.linear(F.prelu(x.reshape(-1, 16), layer.slope), layer.fc.weight, layer.fc.bias).view(2, 5, 8)


@pytest.mark.parametrize('bias', [True, False])
def test_matches_prelu_then_linear_forward_and_backward(bias):
    layer, x = layer_and_input(torch.float64, bias)
    grad_out = torch.randn(2, 5, 8, dtype=torch.float64)
    params = [x, *layer.parameters()]
    fast = torch.autograd.grad(layer(x), params, grad_out)
    reference = torch.autograd.grad(plain(layer, x), params, grad_out)
    torch.testing.assert_close(layer(x), plain(layer, x))
    for f, r in zip(fast, reference):
        torch.testing.assert_close(f, r)


def test_gradcheck():
    layer, x = layer_and_input(torch.float64)
    inputs = (x, layer.slope, layer.fc.weight, layer.fc.bias)
    assert torch.autograd.gradcheck(prelu_linear, inputs)


def test_keeps_no_activation_but_its_input_for_backward():
    """The PReLU output (M x C) is recomputed in the backward pass, not kept."""
    layer, x = layer_and_input()
    assert saved_activation_bytes(layer, x) == x.numel() * x.element_size()


def test_the_backward_pass_holds_two_tensors_of_the_input_s_size_at_a_time():
    """The recomputed PReLU output and the input's gradient, whose buffers serve the other terms."""
    layer, x = layer_and_input()
    out = layer(x)
    live, most = [0], [0]

    def freed():
        live[0] -= 1

    class Allocations(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            if isinstance(result, torch.Tensor) and result.numel() == x.numel() and not func.is_view \
                    and not func._schema.is_mutable:
                live[0] += 1
                most[0] = max(most[0], live[0])
                weakref.finalize(result, freed)
            return result

    with Allocations():
        out.backward(torch.ones_like(out))
    assert most[0] == 2


def test_bf16_autocast_agrees_with_float32():
    layer, x = layer_and_input()
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out = layer(x)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16
    grads = [x.grad, layer.slope.grad, layer.fc.weight.grad]
    reference = torch.autograd.grad(plain(layer, x).sum(), [x, layer.slope, layer.fc.weight])
    for g, r in zip(grads, reference):
        assert g.dtype == r.dtype
        torch.testing.assert_close(g, r, rtol=.05, atol=.05)


def test_slopes_start_at_a_quarter_and_init_weights_restores_them():
    layer = PReLULinear(4, 2)
    assert torch.equal(layer.slope, torch.full((4,), .25))
    with torch.no_grad():
        layer.slope.zero_()
    layer.init_weights()
    assert torch.equal(layer.slope, torch.full((4,), .25))


def test_scripted_and_no_grad_paths_agree_with_the_autograd_path():
    layer, x = layer_and_input()
    expected = layer(x)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), expected)
        torch.testing.assert_close(torch.jit.script(layer)(x), expected)


def test_a_module_in_place_of_fc_is_called_on_the_prelu_output():
    """What PEFT does to a LoRA target: ``fc`` replaced by a module that wraps it."""
    torch.manual_seed(0)
    layer = PReLULinear(6, 4)
    calls = []

    class Wrapped(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            calls.append(x)
            return self.inner(x) + 1.

    x = torch.randn(2, 3, 6, requires_grad=True)
    expected = layer(x) + 1.
    layer.fc = Wrapped(layer.fc)
    torch.testing.assert_close(layer(x), expected)
    torch.testing.assert_close(calls[0], F.prelu(x.reshape(-1, 6), layer.slope).view(2, 3, 6))
