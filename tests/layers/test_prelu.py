"""PReLU + Linear on tokens: a per-channel PReLU over the last dim followed by ``nn.Linear``, in plain autograd (double
backward included) and autocast (TorchScript: in every QIMIA model, tests/models/test_vit_qimia.py)."""
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
def test_matches_prelu_then_linear_and_passes_gradcheck_and_gradgradcheck(bias):
    layer, x = layer_and_input(torch.float64, bias)
    torch.testing.assert_close(layer(x), plain(layer, x))
    with torch.no_grad():
        torch.testing.assert_close(layer(x), plain(layer, x))

    owners = [(layer, 'slope'), (layer.fc, 'weight')] + [(layer.fc, 'bias')] * bias

    def f(x, *params):
        for (module, name), p in zip(owners, params):
            setattr(module, name, p)
        return layer(x)

    inputs = (x, *(getattr(module, name).detach().requires_grad_() for module, name in owners))
    for module, name in owners:
        delattr(module, name)  # plain tensors in their place
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
