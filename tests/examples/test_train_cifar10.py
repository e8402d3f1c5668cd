"""examples/train_cifar10.py on the repository's CIFAR-10 sample, with a tiny budget: it trains, saves a checkpoint
that ``timm.create_model(..., checkpoint_path=...)`` loads, and gives the accuracy of that loaded model."""
import argparse

import pytest
import timm
import torch
from timm.data import create_dataset, create_transform, resolve_data_config
from torch.utils.data import DataLoader, Subset


@pytest.mark.parametrize('model_name', ['vit_hyperbf_tiny', 'vit_qimia_tiny'])
def test_trains_saves_a_checkpoint_timm_loads_and_gives_its_accuracy(example, model_name, tmp_path, cifar10_sample):
    result = example('train_cifar10.py').main([
        '--data', str(cifar10_sample), '--model', model_name, '--model-kwargs', 'depth=1', '--epochs', '1',
        '--train-images', '32', '--test-images', '40', '--batch-size', '16', '--threads', '1', '--workers', '0',
        '--output', str(tmp_path)])
    assert result['checkpoint'] == tmp_path / model_name / 'last.pth.tar'
    model = timm.create_model(model_name, num_classes=10, depth=1, checkpoint_path=str(result['checkpoint'])).eval()
    test_set = create_dataset('', root=str(cifar10_sample / 'test'))  # 40 test images evenly spread over the classes
    test_set.transform = create_transform(**resolve_data_config(dict(input_size=(3, 32, 32), crop_pct=1.0),
                                                                model=model))
    images, targets = next(iter(DataLoader(Subset(test_set, [i * 5 for i in range(40)]), batch_size=40)))
    with torch.inference_mode():
        assert result['top1'] == pytest.approx(100. * (model(images).argmax(-1) == targets).float().mean().item())


def test_by_default_trains_on_the_repositorys_archive_with_a_held_out_validation_split(example, tmp_path):
    result = example('train_cifar10.py').main([
        '--model-kwargs', 'depth=1', '--train-images', '100', '--val-images', '100', '--test-images', '20',
        '--batch-size', '50', '--threads', '1', '--workers', '0', '--cache-dir', str(tmp_path / 'cache'),
        '--output', str(tmp_path)])
    assert result['val_top1'] == round(result['val_top1'])  # a share of 100 images: a whole percentage
    assert len(list((tmp_path / 'cache').iterdir())) == 1  # the archive, extracted once into --cache-dir


def test_holdout_split_is_disjoint_balanced_and_complete(example):
    script = example('train_cifar10.py')
    train, val = script.holdout_split(1000, 100)
    assert sorted(train + val) == list(range(1000)) and not set(train) & set(val)
    assert [i // 100 for i in val] == [c for c in range(10) for _ in range(10)]  # 10 per class of 100 sorted images
    assert script.holdout_split(1000, 0) == (list(range(1000)), [])
    with pytest.raises(SystemExit, match='--val-images 1000'):
        script.holdout_split(1000, 1000)


def test_a_damaged_archive_is_named_and_leaves_nothing_in_the_cache(example, tmp_path, usage_error):
    archive = tmp_path / 'cut.tar.gz'
    archive.write_bytes((example('train_cifar10.py').SAMPLE).read_bytes()[:100_000])  # cut short while downloading
    message = usage_error(lambda: example('train_cifar10.py').image_folder(archive, tmp_path / 'cache'))
    assert message.startswith(f'--data {archive}: a damaged archive')
    assert list((tmp_path / 'cache').iterdir()) == []  # no half-extracted folder for a later run to take


@pytest.mark.parametrize('argv, named', [
    (['--model', 'vit_hyperbf_tinyy'], 'did you mean vit_hyperbf_tiny'),
    (['--model', 'vit_hyperbf_tiny.bogus'], "no tag 'bogus'"),
    (['--data', 'missing_dir'], '--data missing_dir'),
    (['--data', 'TEXT'], '--data TEXT: neither a folder nor a readable archive'),
    (['--output', 'TEXT'], '--output TEXT/vit_hyperbf_tiny: TEXT is a file'),
    (['--train-images', '8', '--batch-size', '64'], '--train-images 8 gives no full batch of --batch-size 64'),
    (['--epochs', '0'], '--epochs must be an integer >= 1, got 0'),
    (['--model-kwargs', 'bogus=1'], "--model-kwargs bogus=1: vit_hyperbf_tiny cannot be built with them"),
    (['--model-kwargs', 'depth=0'], 'depth must be an integer >= 1, got 0'),
])
def test_bad_arguments_exit_with_one_line_naming_them_before_anything_is_built(example, argv, named, tmp_path,
                                                                               monkeypatch, usage_error):
    script = example('train_cifar10.py')
    (tmp_path / 'notes.txt').write_text('not an archive\n')
    monkeypatch.chdir(tmp_path)
    create_model = timm.create_model  # only on the meta device, to check --model-kwargs
    monkeypatch.setattr(timm, 'create_model', lambda *a, **kw: create_model(*a, **kw) if kw.get('device') == 'meta'
                        else None)
    argv = [str(tmp_path / 'notes.txt') if arg == 'TEXT' else arg for arg in argv]
    assert named.replace('TEXT', str(tmp_path / 'notes.txt')) in usage_error(lambda: script.main(argv))
    assert not (tmp_path / 'output').exists()


@pytest.mark.parametrize('name, kwargs', [
    ('vit_hyperbf_tiny', {}),                                           # ours: timm-hbf's checked loading
    ('vit_tiny_patch16_224', dict(img_size=32, patch_size=4)),          # timm's: checkpoint_path
])
def test_a_checkpoint_loads_its_ema_weights_or_names_the_model_it_does_not_fit(example, name, kwargs, tmp_path,
                                                                                usage_error):
    script = example('train_cifar10.py')
    torch.manual_seed(0)
    trained, ema = (timm.create_model(name, num_classes=10, depth=1, **kwargs) for _ in range(2))
    path = tmp_path / 'last.pth.tar'
    torch.save(dict(arch=name, state_dict=trained.state_dict(), state_dict_ema=ema.state_dict()), path)
    args = argparse.Namespace(model=name, model_kwargs=dict(kwargs, depth=1, num_classes=10), pretrained=False,
                              checkpoint=str(path))
    loaded = script.create_model(args).state_dict()
    assert loaded.keys() == ema.state_dict().keys()
    assert all(torch.equal(loaded[key], value) for key, value in ema.state_dict().items())
    args.model_kwargs['depth'] = 2  # a model of other weights
    assert f'{path} does not fit {name}' in usage_error(lambda: script.create_model(args))
