"""examples/mlp_linearity.py: how far each block's MLP is from an affine map, on real test images."""
import pytest
import torch


def test_held_out_r2_is_one_for_an_affine_map_and_low_for_a_nonlinear_one(example):
    script = example('mlp_linearity.py')
    x = torch.randn(2000, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert script.held_out_r2(x, x @ torch.randn(8, 3, dtype=torch.float64) + 1.) == pytest.approx(1.)
    assert script.held_out_r2(x, x.square()) < .05


def test_independent_hyperbf_units_start_nearly_affine_normalized_ones_do_not(example, cifar10_sample):
    """Untrained: the unit exponents spread by about 1 / sqrt(192) for independent units and about 1 for normalized
    ones (tests/layers/test_hyperbf_mlp.py), and so is how affine the layers are."""
    script = example('mlp_linearity.py')
    common = ['--model', 'vit_hyperbf_tiny', '--data', str(cifar10_sample), '--images', '50', '--model-kwargs',
              'depth=2']
    independent, normalized = script.main(common), script.main(common + ['mlp_normalized=True'])
    assert min(independent['r2']) > .99 and max(independent['unit_spread']) < .1
    assert max(normalized['r2']) < .9 and min(normalized['unit_spread']) > .7
    assert independent['mlp_gamma'] == [pytest.approx((1 / 384,) * 3)] * 2  # 1 / (2 D), D = 192
    assert normalized['mlp_gamma'] == [pytest.approx((1 / (2 * 192 ** .5),) * 3)] * 2  # 1 / (2 sqrt(D))


def test_timms_vit_and_models_without_token_mlps(example, cifar10_sample):
    script = example('mlp_linearity.py')
    stats = script.main(['--model', 'vit_tiny_patch16_224', '--model-kwargs', 'depth=1', 'img_size=32',
                         'patch_size=4', '--img-size', '32', '--data', str(cifar10_sample), '--images', '20'])
    assert len(stats['r2']) == 1 and stats['unit_spread'] == stats['mlp_gamma'] == stats['attn_gamma'] == []
    for model in (['resnet18'], ['vit_qimia_tiny', '--model-kwargs', 'depth=1']):  # no blocks; MLPs over a memory
        with pytest.raises(SystemExit, match=f'{model[0]} has no blocks whose MLP maps tokens to tokens'):
            script.main(['--model', *model, '--data', str(cifar10_sample), '--images', '20'])


@pytest.mark.parametrize('argv, named', [
    (['--model', 'nonexistent_model'], '--model nonexistent_model'),
    (['--data', 'missing_dir'], '--data missing_dir'),
])
def test_bad_arguments_exit_with_one_line_naming_them(argv, named, example, monkeypatch, tmp_path, usage_error):
    script = example('mlp_linearity.py')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(script, 'model_and_test_images', None)  # a computation would fail here
    assert named in usage_error(lambda: script.main(argv))
