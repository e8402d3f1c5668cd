"""examples/mlp_linearity.py: how far each block's MLP is from an affine map, on real test images."""

import pytest
import torch


@pytest.fixture
def linearity_script(load_example):
    return load_example('mlp_linearity.py')


def test_held_out_r2_is_one_for_an_affine_map_and_low_for_a_nonlinear_one(linearity_script):
    x = torch.randn(2000, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    affine = x @ torch.randn(8, 3, dtype=torch.float64) + 1.
    assert linearity_script.held_out_r2(x, affine) == pytest.approx(1.)
    assert linearity_script.held_out_r2(x, x.square()) < .05


def test_independent_hyperbf_units_start_nearly_affine_normalized_ones_do_not(linearity_script, cifar10_sample, capsys):
    """Untrained, on the sample's test images: the spread of the unit exponents is about 1 / sqrt(192) for
    independent units and about 1 for normalized ones (tests/layers/test_hyperbf_mlp.py), and so is how affine the
    layers are."""
    common = ['--model', 'vit_hyperbf_tiny', '--data', str(cifar10_sample), '--images', '50', '--model-kwargs',
              'depth=2']
    independent = linearity_script.main(common)
    normalized = linearity_script.main(common + ['mlp_normalized=True'])
    assert min(independent['r2']) > .99 and max(independent['unit_spread']) < .1
    assert max(normalized['r2']) < .9 and min(normalized['unit_spread']) > .7
    # the widths as initialised: 1 / (2 D) for independent units, 1 / (2 sqrt(D)) normalised, D = 192; attention
    # 1 / (2 sqrt(64)) per head of 64 channels
    assert independent['mlp_gamma'] == [pytest.approx((1 / 384,) * 3)] * 2
    assert normalized['mlp_gamma'] == [pytest.approx((1 / (2 * 192 ** .5),) * 3)] * 2
    assert independent['attn_gamma'] == [pytest.approx((.0625, .0625))] * 2
    out = capsys.readouterr().out
    assert 'block  1: affine R^2' in out and 'MLP widths 2.60e-03-2.60e-03 (median 2.60e-03)' in out


def test_timms_vit_and_a_model_without_mlps(linearity_script, cifar10_sample):
    stats = linearity_script.main(['--model', 'vit_tiny_patch16_224', '--model-kwargs', 'depth=1', 'img_size=32',
                                   'patch_size=4', '--img-size', '32', '--data', str(cifar10_sample), '--images', '20'])
    assert len(stats['r2']) == 1 and stats['unit_spread'] == stats['mlp_gamma'] == stats['attn_gamma'] == []
    # no blocks; blocks whose MLPs read and write a memory of entries
    for model in (['resnet18'], ['vit_qimia_tiny', '--model-kwargs', 'depth=1']):
        with pytest.raises(SystemExit, match=f'{model[0]} has no blocks whose MLP maps tokens to tokens'):
            linearity_script.main(['--model', *model, '--data', str(cifar10_sample), '--images', '20'])


@pytest.mark.parametrize('argv, message', [
    (['--model', 'nonexistent_model'], '--model nonexistent_model: timm knows no such model'),
    (['--data', 'missing_dir'], '--data missing_dir: no such file or folder'),
])
def test_bad_arguments_exit_with_one_line_before_anything_is_computed(argv, message, linearity_script, monkeypatch,
                                                                      tmp_path, usage_error):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(linearity_script, 'model_and_test_images', None)  # a computation would fail here
    assert f'error: {message}' in usage_error(lambda: linearity_script.main(argv))
