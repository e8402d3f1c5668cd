"""PReLU + Linear on tokens: a per-channel PReLU over the last dim followed by ``nn.Linear``, in plain autograd (double
backward included), TorchScript and autocast."""
import pytest
import torch
import torch.nn.functional as F

from timm_hbf.layers import PReLULinear


def layer_and_input(dtype=torch.float32, bias=True, seed=0):
    torch.manual_seed(seed)
    layer = PReLULinear(16, 8, bias=bias).to(dtype)
    with torch.no_grad():
        layer.slope.uniform_(-.5, 1.5)  # distinct per channel, negative ones included
    x = torch.randn(2, 5, 16, dtype=dtype, requires_grad=True)
    return layer, x


def plain(layer, x):
    """PReLU over the channel (last) dim, then Linear, written out."""
    return F.linear(torch.where(x >= 0, x, x * layer.slope), layer.fc.weight, layer.fc.bias)


@pytest.mark.parametrize('bias', [True, False])
def test_matches_prelu_then_linear_forward_and_backward(bias):
    layer, x = layer_and_input(torch.float64, bias)
    grad_out = torch.randn(2, 5, 8, dtype=torch.float64)
    params = [x, *layer.parameters()]
    torch.testing.assert_close(layer(x), plain(layer, x))
    with torch.no_grad():
        torch.testing.assert_close(layer(x), plain(layer, x))
    for got, expected in zip(torch.autograd.grad(layer(x), params, grad_out),
                             torch.autograd.grad(plain(layer, x), params, grad_out)):
        torch.testing.assert_close(got, expected)


def test_gradcheck_and_gradgradcheck():
    layer, x = layer_and_input(torch.float64)

    def f(x, slope, weight, bias):
        layer.slope, layer.fc.weight, layer.fc.bias = slope, weight, bias
        return layer(x)

    inputs = (x, *(p.detach().requires_grad_() for p in (layer.slope, layer.fc.weight, layer.fc.bias)))
    del layer.slope, layer.fc.weight, layer.fc.bias  # plain tensors in their place
    assert torch.autograd.gradcheck(f, inputs)
    assert torch.autograd.gradgradcheck(f, inputs)


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


@pytest.mark.slow
def test_the_scripted_layer_gives_the_eager_outputs():
    layer, x = layer_and_input()
    torch.testing.assert_close(torch.jit.script(layer)(x), layer(x))


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
    torch.testing.assert_close(calls[0], torch.where(x >= 0, x, x * layer.slope))
