"""examples/train_cifar10.py on the repository's CIFAR-10 sample, with a tiny budget: it trains, saves a checkpoint
that ``timm.create_model(..., checkpoint_path=...)`` loads, and prints the accuracy of that loaded model."""
import re

import pytest
import timm
import torch
from timm.data import create_dataset, create_transform, resolve_data_config
from torch.utils.data import DataLoader, Subset

import timm_hbf  # noqa: F401  (registers the models)
from tests.helpers import ROOT, load_module

SCRIPT = ROOT / 'examples' / 'train_cifar10.py'
MODELS = ['vit_hyperbf_tiny', 'vit_qimia_tiny']


def load_script():
    return load_module(SCRIPT)


@pytest.fixture
def threads():
    """The script sets torch's thread count for the process: put it back."""
    count = torch.get_num_threads()
    yield
    torch.set_num_threads(count)


@pytest.mark.parametrize('model_name', MODELS)
def test_train_cifar10(model_name, capsys, tmp_path, threads, cifar10_sample):
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


def test_holdout_split_is_disjoint_balanced_and_complete():
    script = load_script()
    train, val = script.holdout_split(1000, 100)
    assert len(val) == 100 and not set(train) & set(val) and sorted(train + val) == list(range(1000))
    assert [i // 100 for i in val] == [c for c in range(10) for _ in range(10)]  # 10 per class of 100 sorted images
    assert script.holdout_split(1000, 0) == (list(range(1000)), [])
    with pytest.raises(ValueError, match='--val-images 1000 leaves none of the 1000 train images'):
        script.holdout_split(1000, 1000)


def test_by_default_trains_on_the_repositorys_sample_with_a_held_out_validation_split(capsys, tmp_path, threads):
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


def test_data_without_train_and_test_folders_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match=r'--data .*: no train/ and test/ folders .*ImageFolder layout'):
        load_script().image_folder(tmp_path / 'nowhere', tmp_path / 'cache')
