"""HyperBFMlp: phi(x) = sum_i c_i K(x, t_i) + b (memo Eq. 4 and 7), alive at init and as cheap as an MLP."""
import math

import pytest
import torch
from timm.layers import Mlp
from timm.models.vision_transformer import Block

from timm_hbf.layers import HyperBFMlp

from ..helpers import ShapeRecorder, dropout_matches_its_expectation, layer_normed, saved_activation_bytes


def brute_force_units(mlp, x):
    """K(x, t_i) from explicit differences."""
    diff = mlp.kernel.project(x[..., None, :] - mlp.centers)
    log_k = -mlp.kernel.gamma() * diff.pow(2).sum(-1)
    return log_k.softmax(-1) if mlp.normalized else log_k.exp()


@pytest.mark.parametrize('normalized', [False, True], ids=['independent', 'normalized'])
@pytest.mark.parametrize('kernel', ['gaussian', 'laplacian'])
@pytest.mark.parametrize('dim, centers', [(192, 768), (768, 3000)])
def test_units_are_alive_at_init_on_layer_normed_inputs(dim, centers, kernel, normalized):
    """Independent units start with exponents ``-gamma d`` about -1 (``K`` about exp(-1)), every unit neither ~0 nor
    ~1; normalised ones with logits that vary across centres by about 1, as in scaled dot-product attention. Every
    centre and width gets a gradient."""
    torch.manual_seed(0)
    mlp = HyperBFMlp(dim, centers, kernel=kernel, normalized=normalized)
    x = layer_normed(4, 16, dim)
    log_units = mlp.log_units(x)
    if normalized:
        assert .5 < log_units.std(-1).mean() < 2.
    else:
        assert -2. < log_units.mean() < -.5
        per_unit = mlp.activations(x).mean(dim=(0, 1))
        assert 0.1 < per_unit.mean() < 0.9 and per_unit.min() > 0.01 and per_unit.max() < 0.99
    mlp(x).square().mean().backward()
    for name, p in mlp.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert (mlp.centers.grad.abs().sum(-1) > 0).all() and (mlp.kernel.log_gamma.grad != 0).all()


@pytest.mark.parametrize('dim', [192, 768])
def test_independent_units_start_nearly_linear_normalized_ones_do_not(dim):
    """On LayerNorm'd tokens ``log K(x, t_i)`` is ``2 gamma x . t_i`` plus a constant, which varies over the tokens
    with std ``2 gamma ||t_i||``: ``1 / sqrt(D)`` for independent units (``gamma = 1 / (2 D)``), where ``exp`` is
    nearly linear, and about 1 for normalized ones (``gamma = 1 / (2 sqrt(D))``), where the softmax is not; and
    init_weights restores the init."""
    torch.manual_seed(0)
    x = layer_normed(8, 64, dim).reshape(-1, dim)
    for normalized, spread, gamma in ((False, dim ** -.5, 1 / (2 * dim)), (True, 1., 1 / (2 * dim ** .5))):
        mlp = HyperBFMlp(dim, 4 * dim, normalized=normalized)
        assert torch.allclose(mlp.kernel.gamma(), torch.tensor(gamma))
        assert abs(mlp.log_units(x).std(0).median() / spread - 1) < .1, normalized
    with torch.no_grad():
        mlp.centers.zero_()
    mlp.init_weights()
    assert mlp.centers.std() > 0.5


@pytest.mark.parametrize('options', [dict(), dict(normalized=True), dict(mahalanobis=True)],
                         ids=['units', 'normalized', 'mahalanobis'])
def test_matches_the_definition_forward_and_backward(options):
    torch.manual_seed(0)
    mlp = HyperBFMlp(16, 24, dtype=torch.float64, **options)
    with torch.no_grad():
        mlp.kernel.log_gamma.uniform_(-4, -2)
        if mlp.kernel.metric is not None:
            mlp.kernel.metric.add_(0.2 * torch.randn_like(mlp.kernel.metric))
    x = layer_normed(2, 5, 16).double().requires_grad_()
    expected = mlp.readout(brute_force_units(mlp, x))
    out = mlp(x)
    torch.testing.assert_close(out, expected)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x] + list(mlp.parameters()), g)
    grads_expected = torch.autograd.grad(expected, [x] + list(mlp.parameters()), g)
    for a, b in zip(grads, grads_expected):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize('sharpen', [1., 50.])
def test_units_under_bf16_autocast_are_those_of_float32_but_for_the_products_rounding(sharpen):
    """Under autocast ``2 gamma x.t`` runs in bf16 (the layer's one large product beside the readout), rounded once:
    every unit's exponent is off by at most 2^-8 of ``2 gamma_i |x| |t_i|`` (about 2^-8 at the initial widths)."""
    torch.manual_seed(0)
    mlp = HyperBFMlp(192, 768)
    with torch.no_grad():
        mlp.kernel.log_gamma.add_(math.log(sharpen))
    x = layer_normed(4, 65, 192)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        under_autocast = mlp.activations(x)
        assert mlp(x).dtype == torch.bfloat16  # the readout runs in bf16
    exact = mlp.double().activations(x.double())
    bound = 2 ** -8 * 2 * mlp.kernel.gamma() * x.double().norm(dim=-1, keepdim=True) * mlp.centers.norm(dim=-1)
    assert ((under_autocast.double() - exact).abs() <= exact * bound.expm1()).all()


def test_cost_is_that_of_an_mlp_and_backward_keeps_less_than_a_gelu_mlp():
    """No (tokens, centres, dim) tensor, forward or backward; backward keeps the input, its norm and the units for
    each token: less than the input, fc1 and GELU outputs of timm's Mlp."""
    dim, centers = 32, 128
    with ShapeRecorder() as recorder:
        HyperBFMlp(dim, centers)(layer_normed(2, 9, dim)).sum().backward()
    assert max(s.numel() for s in recorder.shapes) <= max(2 * 9 * centers, centers * dim)  # (B, N, K, D): 32x more

    def saved_bytes_per_token(module):  # weight-sized tensors cancel
        saved = [saved_activation_bytes(module, layer_normed(n, dim).requires_grad_()) for n in (8, 24)]
        return (saved[1] - saved[0]) / 16

    assert saved_bytes_per_token(HyperBFMlp(dim, centers)) == 4 * (dim + 1 + centers)
    assert saved_bytes_per_token(Mlp(dim, centers)) == 4 * (dim + 2 * centers)


def test_dropout_acts_in_training_only_and_keeps_the_expected_output():
    """Unit activations and outputs: :func:`dropout_matches_its_expectation`."""
    torch.manual_seed(0)
    plain = HyperBFMlp(48, 96)
    with_dropout = HyperBFMlp(48, 96, drop=.5)
    with_dropout.load_state_dict(plain.state_dict())
    dropout_matches_its_expectation(with_dropout, plain, layer_normed(1, 1, 48)[0].expand(20000, -1))


def test_timm_block_drives_the_layer_with_its_arguments():
    """act_layer (unused: the kernel is the nonlinearity), bias, drop and (scale_mlp_norm) a norm over the units."""
    block = Block(48, 3, mlp_ratio=2., scale_mlp_norm=True, proj_bias=False, mlp_layer=HyperBFMlp)
    assert isinstance(block.mlp, HyperBFMlp) and block.mlp.centers.shape == (96, 48)
    assert isinstance(block.mlp.norm, torch.nn.LayerNorm) and block.mlp.readout.bias is None
    x = layer_normed(2, 5, 48)
    expected = block.mlp.readout(block.mlp.norm(block.mlp.activations(x)))
    torch.testing.assert_close(block.mlp(x), expected)
    assert block.mlp.fc2 is block.mlp.readout  # the name timm's ViT uses to rescale the last layer (fix_init)


@pytest.mark.parametrize('kwargs, error, message', [
    (dict(hidden_features=0), ValueError, 'hidden_features .*got 0'),
    (dict(kernel='cauchy'), ValueError, "kernel .*'cauchy'"),
])
def test_a_bad_argument_raises_naming_it_and_its_value(kwargs, error, message):
    with pytest.raises(error, match=message):
        HyperBFMlp(8, **kwargs)
