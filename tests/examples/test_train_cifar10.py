"""examples/train_cifar10.py on the repository's CIFAR-10 sample, with a tiny budget: it trains, saves a checkpoint
that ``timm.create_model(..., checkpoint_path=...)`` loads, and prints the accuracy of that loaded model."""
import argparse
import re
from pathlib import Path

import pytest
import timm
import torch
from timm.data import create_dataset, create_transform, resolve_data_config
from torch.utils.data import DataLoader, Subset

import timm_hbf  # noqa: F401  (registers the models)
from tests.helpers import ROOT

SAMPLE = ROOT / 'data' / 'cifar10-mini-jpeg.tar.gz'
MODELS = ['vit_hyperbf_tiny', 'vit_qimia_tiny']


@pytest.fixture
def load_script(load_example):
    """The script loaded afresh, with its neighbours importable."""
    return lambda: load_example('train_cifar10.py')


@pytest.fixture
def threads():
    """The script sets torch's thread count for the process: put it back."""
    count = torch.get_num_threads()
    yield
    torch.set_num_threads(count)


@pytest.mark.parametrize('model_name', MODELS)
def test_train_cifar10(load_script, model_name, capsys, tmp_path, threads, cifar10_sample):
    script = load_script()
    result = script.main([
        '--data', str(cifar10_sample), '--model', model_name, '--model-kwargs', 'depth=2', '--epochs', '2',
        '--train-images', '64', '--test-images', '40', '--batch-size', '16', '--threads', '1', '--workers', '0',
        '--output', str(tmp_path),
    ])
    out, err = capsys.readouterr()
    assert 'train: 2 x 64 of 1000 images (4 updates of 16 per epoch), float32; test: 40 of 200 images' in out
    assert 'epoch 2/2: 100%' in err  # the progress bar
    assert re.search(r'^time: \d+ s in all \(\d+ s training, \d+ s evaluation\)$', out, re.M)

    checkpoint = tmp_path / model_name / 'last.pth.tar'
    assert result['checkpoint'] == checkpoint and checkpoint.is_file()
    model = timm.create_model(model_name, num_classes=10, depth=2, checkpoint_path=str(checkpoint)).eval()
    # the same 40 test images, evenly spread over the classes, through the model's eval transform
    test_set = create_dataset('', root=str(cifar10_sample / 'test'))
    test_set.transform = create_transform(**resolve_data_config(dict(input_size=(3, 32, 32), crop_pct=1.0),
                                                                model=model))
    images, targets = next(iter(DataLoader(Subset(test_set, [i * 200 // 40 for i in range(40)]), batch_size=40)))
    with torch.inference_mode():
        top1 = 100. * (model(images).argmax(-1) == targets).float().mean().item()
    assert result['top1'] == pytest.approx(top1)
    assert f'test accuracy: {top1:.2f} % top-1 on 40 CIFAR-10 test images (chance: 10 %)' in out


def test_holdout_split_is_disjoint_balanced_and_complete(load_script):
    script = load_script()
    train, val = script.holdout_split(1000, 100)
    assert len(val) == 100 and not set(train) & set(val) and sorted(train + val) == list(range(1000))
    assert [i // 100 for i in val] == [c for c in range(10) for _ in range(10)]  # 10 per class of 100 sorted images
    assert script.holdout_split(1000, 0) == (list(range(1000)), [])
    with pytest.raises(SystemExit, match='--val-images 1000 leaves none of the 1000 train images'):
        script.holdout_split(1000, 1000)


@pytest.mark.slow
def test_by_default_trains_on_the_repositorys_sample_with_a_held_out_validation_split(load_script, capsys, tmp_path,
                                                                                      threads):
    script = load_script()
    result = script.main([
        '--model', 'vit_hyperbf_tiny', '--model-kwargs', 'depth=1', '--epochs', '1',
        '--train-images', '2000', '--val-images', '100', '--test-images', '20', '--batch-size', '50',
        '--threads', '1', '--workers', '0', '--cache-dir', str(tmp_path / 'cache'), '--output', str(tmp_path),
    ])
    out = capsys.readouterr().out
    # the sample's 1000 train images less 100 held out leave 900, so an epoch asking for 2000 takes 18 updates of 50
    assert 'train: 1 x 900 of 900 images (18 updates of 50 per epoch)' in out
    assert '; validation: 100 held-out train images' in out
    assert f"validation accuracy: {result['val_top1']:.2f} % top-1 on 100 held-out train images" in out
    assert result['val_top1'] == round(result['val_top1'])  # a share of 100 images: a whole percentage
    assert len(list((tmp_path / 'cache').iterdir())) == 1  # the archive, extracted once into --cache-dir


def test_data_without_train_and_test_folders_names_the_fix(load_script, tmp_path, usage_error):
    (tmp_path / 'data').mkdir()
    message = usage_error(lambda: load_script().image_folder(tmp_path / 'data', tmp_path / 'cache'))
    assert re.match(r'--data .*data: no train/ and test/ folders .*ImageFolder layout', message)


def test_a_damaged_archive_is_named_and_leaves_nothing_in_the_cache(load_script, tmp_path, usage_error):
    archive = tmp_path / 'cut.tar.gz'
    archive.write_bytes(SAMPLE.read_bytes()[:100_000])  # cut short while downloading
    message = usage_error(lambda: load_script().image_folder(archive, tmp_path / 'cache'))
    assert message.startswith(f'--data {archive}: a damaged archive (') and 'copy it again' in message
    assert list((tmp_path / 'cache').iterdir()) == []  # no half-extracted folder for a later run to take


@pytest.fixture
def text_file(tmp_path) -> Path:
    (tmp_path / 'notes.txt').write_text('not an archive\n')
    return tmp_path / 'notes.txt'


@pytest.mark.parametrize('argv, message', [
    (['--model', 'nonexistent_model'],
     "--model nonexistent_model: timm knows no such model (see timm.list_models(module="
     "['vit_hyperbf', 'vit_qimia', 'vit_attnres'])"),
    (['--model', 'vit_hyperbf_tinyy'], '--model vit_hyperbf_tinyy: timm knows no such model (did you mean '
                                       'vit_hyperbf_tiny or '),
    (['--model', 'vit_hyperbf_tiny.bogus'], "--model vit_hyperbf_tiny.bogus: vit_hyperbf_tiny has no tag 'bogus' "
                                            '(its tags: vit_hyperbf_tiny.cifar10_100ep, '),
    (['--data', 'missing_dir'], '--data missing_dir: no such file or folder'),
    (['--data', 'TEXT'], '--data TEXT: neither a folder nor a readable archive. Give a CIFAR-10 folder or .tar.gz'),
    (['--output', 'TEXT'], '--output TEXT/vit_hyperbf_tiny: TEXT is a file, not a folder'),
    (['--train-images', '8', '--batch-size', '64'],
     '--train-images 8 gives no full batch of --batch-size 64: lower --batch-size'),
    (['--epochs', '0'], '--epochs must be an integer >= 1, got 0'),
    (['--batch-size', '0'], '--batch-size must be an integer >= 1, got 0'),
    (['--test-images', '0'], '--test-images must be an integer >= 1, got 0'),
])
def test_bad_arguments_exit_with_one_line_before_anything_is_built(load_script, argv, message, text_file, tmp_path,
                                                                   monkeypatch, usage_error):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(timm, 'create_model', None)  # a model built would fail here, with a traceback
    argv = [str(text_file) if arg == 'TEXT' else arg for arg in argv]
    assert f"error: {message.replace('TEXT', str(text_file))}" in usage_error(lambda: load_script().main(argv))
    assert not (tmp_path / 'output').exists()


@pytest.mark.parametrize('item, reason', [
    ('bogus=1', "VisionTransformer.__init__() got an unexpected keyword argument 'bogus'"),
    ('depth=0', 'depth must be an integer >= 1, got 0.'),
])
def test_model_arguments_the_model_does_not_take_exit_with_one_line_before_training(load_script, item, reason, tmp_path,
                                                                                   monkeypatch, usage_error):
    """Checked on the meta device: nothing is allocated, trained or written."""
    monkeypatch.chdir(tmp_path)
    create_model, devices = timm.create_model, []
    monkeypatch.setattr(timm, 'create_model', lambda *args, **kwargs: devices.append(kwargs.get('device')) or
                        create_model(*args, **kwargs))
    message = usage_error(lambda: load_script().main(['--model-kwargs', item]))
    assert message.endswith(f'error: --model-kwargs {item}: vit_hyperbf_tiny cannot be built with them ({reason})')
    assert devices == ['meta'] and not (tmp_path / 'output').exists()


def test_a_batch_larger_than_the_train_images_is_refused_before_training(load_script, cifar10_sample, tmp_path,
                                                                         usage_error):
    """The parse-time check knows --train-images only: 900 images left by --val-images give no batch of 1000."""
    message = usage_error(lambda: load_script().main([
        '--data', str(cifar10_sample), '--model-kwargs', 'depth=1', '--train-images', '2000', '--val-images', '100',
        '--batch-size', '1000', '--output', str(tmp_path / 'out')]))
    assert message.startswith('--batch-size 1000 is more than the 900 train images of --data ')
    assert message.endswith('(those --val-images leaves): lower --batch-size.')
    assert not (tmp_path / 'out').exists()


@pytest.mark.parametrize('name, kwargs', [
    ('vit_hyperbf_tiny', {}),                                           # ours: timm-hbf's checked loading
    ('vit_tiny_patch16_224', dict(img_size=32, patch_size=4)),          # timm's: checkpoint_path
])
def test_a_checkpoint_loads_its_ema_weights_and_head(load_script, name, kwargs, tmp_path):
    torch.manual_seed(0)
    trained, ema = (timm.create_model(name, num_classes=10, depth=1, **kwargs) for _ in range(2))
    path = tmp_path / 'last.pth.tar'
    torch.save(dict(arch=name, state_dict=trained.state_dict(), state_dict_ema=ema.state_dict()), path)
    args = argparse.Namespace(model=name, model_kwargs=dict(kwargs, depth=1, num_classes=10), pretrained=False,
                              checkpoint=str(path))
    loaded = load_script().create_model(args)
    assert loaded.state_dict().keys() == ema.state_dict().keys()
    for key, value in ema.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value, msg=key)


@pytest.mark.parametrize('name, kwargs, message', [
    ('vit_qimia_tiny', {}, r'CHECKPOINT does not fit vit_qimia_tiny as built: \d+ missing .* Create the model the '
                           r'weights were trained as'),
    ('vit_tiny_patch16_224', dict(img_size=32, patch_size=4),
     r'--checkpoint CHECKPOINT does not fit vit_tiny_patch16_224 as built: Missing key\(s\) in state_dict: '
     r'"blocks\.0\.mlp\.fc1\.weight".* \(and \d+ more lines\)\. Give the --model and --model-kwargs it was '
     'trained with.'),
])
def test_a_checkpoint_of_another_model_exits_with_one_line(load_script, name, kwargs, message, tmp_path, usage_error):
    path = tmp_path / 'last.pth.tar'
    other = timm.create_model('vit_hyperbf_tiny', depth=1)
    torch.save(dict(arch='vit_hyperbf_tiny', state_dict_ema=other.state_dict()), path)
    args = argparse.Namespace(model=name, model_kwargs=dict(kwargs, depth=1), pretrained=False, checkpoint=str(path))
    assert re.match(message.replace('CHECKPOINT', re.escape(str(path))),
                        usage_error(lambda: load_script().create_model(args)))
