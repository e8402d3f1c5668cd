"""HyperBFMlp: phi(x) = sum_i c_i K(x, t_i) + b (memo Eq. 4 and 7), alive at init and as cheap as an MLP."""
import pytest
import torch
from timm.layers import Mlp

from timm_hbf.layers import HyperBFMlp

from ..helpers import ShapeRecorder, layer_normed, saved_activation_bytes


def brute_force_units(mlp, x):
    """K(x, t_i) from explicit differences."""
    dist_sq = (x[..., None, :] - mlp.centers).pow(2).sum(-1)
    log_k = -mlp.kernel.gamma() * dist_sq
    return log_k.softmax(-1) if mlp.normalized else log_k.exp()


@pytest.mark.parametrize('kernel', ['gaussian', 'laplacian'])
@pytest.mark.parametrize('dim, centers', [(192, 768), (384, 1536), (768, 3072), (768, 3000)])
def test_units_are_alive_at_init_on_layer_normed_inputs(dim, centers, kernel):
    torch.manual_seed(0)
    mlp = HyperBFMlp(dim, centers, kernel=kernel)
    x = layer_normed(4, 16, dim)
    act = mlp.activations(x)
    # neither ~0 nor ~1, for every unit
    assert 0.1 < act.mean() < 0.9
    per_unit = act.mean(dim=(0, 1))
    assert per_unit.min() > 0.01 and per_unit.max() < 0.99
    mlp(x).square().mean().backward()
    for name, p in mlp.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    # every centre and every width moves: no dead unit
    assert (mlp.centers.grad.abs().sum(-1) > 0).all()
    assert (mlp.kernel.log_gamma.grad != 0).all()


def test_the_authors_init_would_be_dead():
    """With gamma = 0.1 (the public code) the same inputs give exp(-124...-186): exactly zero in fp32."""
    torch.manual_seed(0)
    mlp = HyperBFMlp(768, 11)
    with torch.no_grad():
        mlp.kernel.log_gamma.fill_(torch.tensor(0.1).log().item())
    assert (mlp.activations(layer_normed(2, 16, 768)) == 0).all()


@pytest.mark.parametrize('normalized', [False, True])
def test_matches_the_definition_forward_and_backward(normalized):
    torch.manual_seed(0)
    mlp = HyperBFMlp(16, 24, normalized=normalized, dtype=torch.float64)
    with torch.no_grad():
        mlp.kernel.log_gamma.uniform_(-4, -2)
    x = layer_normed(2, 5, 16).double().requires_grad_()
    expected = mlp.readout(brute_force_units(mlp, x))
    out = mlp(x)
    torch.testing.assert_close(out, expected)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x] + list(mlp.parameters()), g)
    grads_expected = torch.autograd.grad(expected, [x] + list(mlp.parameters()), g)
    for a, b in zip(grads, grads_expected):
        torch.testing.assert_close(a, b)


def test_normalized_units_are_a_softmax_over_centres():
    mlp = HyperBFMlp(32, 64, normalized=True)
    act = mlp.activations(layer_normed(3, 7, 32))
    torch.testing.assert_close(act.sum(-1), torch.ones(3, 7))


def test_cost_is_that_of_an_mlp_no_token_by_centre_by_dim_tensor():
    mlp = HyperBFMlp(32, 128)
    x = layer_normed(2, 9, 32)
    with ShapeRecorder() as recorder:
        mlp(x).sum().backward()
    biggest = max(s.numel() for s in recorder.shapes)
    # activations, or centres with their norm channels (padded to 8); (B, N, K, D) would be 32x larger
    assert biggest <= max(2 * 9 * 128, 128 * (32 + 8))


def autograd_nodes(tensor):
    """Names of every node in the autograd graph behind ``tensor``."""
    names, stack, seen = set(), [tensor.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


def test_units_overwrite_a_fresh_tensor_not_a_view():
    """The units are computed in place on the centre product; were that product a view, autograd would copy the
    whole activation back and forth in the backward pass (a ``CopySlices`` node)."""
    out = HyperBFMlp(32, 128)(layer_normed(2, 9, 32).requires_grad_())
    nodes = autograd_nodes(out)
    assert '_GaussianUnitsBackward' in nodes
    assert 'CopySlices' not in nodes


def saved_bytes_per_token(module, dim):
    """What the backward pass keeps for each more token: weight-sized tensors (the augmented centres) cancel."""
    few, many = 8, 24
    saved_few, saved_many = (saved_activation_bytes(module, layer_normed(n, dim).requires_grad_()) for n in (few, many))
    return (saved_many - saved_few) / (many - few)


def test_backward_keeps_the_augmented_points_and_the_units_less_than_a_gelu_mlp():
    dim, centers = 32, 128
    # [x, ||x||^2, 1] padded to a multiple of 8 channels, and the units; not the input itself
    assert saved_bytes_per_token(HyperBFMlp(dim, centers), dim) == 4 * (40 + centers)
    assert saved_bytes_per_token(Mlp(dim, centers), dim) == 4 * (dim + 2 * centers)  # input, fc1 and GELU outputs


def test_init_widths():
    assert torch.allclose(HyperBFMlp(192, 768).kernel.gamma(), torch.tensor(1 / 384))
    assert torch.allclose(HyperBFMlp(192, 768, normalized=True).kernel.gamma(), torch.tensor(1 / (2 * 192 ** 0.5)))
