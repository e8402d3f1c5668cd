"""benchmarks/storage_dtype.py: a checkpoint's test predictions with its weights stored in half precision, the kernel
widths kept in float32 (as ``timm-hbf push`` writes them) and rounded with the rest, and under bf16 autocast."""
import json
from pathlib import Path

import pytest
import timm
import torch
import yaml

from tests.helpers import ROOT, load_module

CIFAR10_NORM = dict(mean=[0.4914, 0.4822, 0.4465], std=[0.247, 0.2435, 0.2616])


@pytest.fixture(scope='module')
def script():
    return load_module(ROOT / 'benchmarks' / 'storage_dtype.py')


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    """A train.py-like output folder: checkpoints of a 2-block ``vit_hyperbf_tiny`` and its ``args.yaml``."""
    torch.manual_seed(0)
    model = timm.create_model('vit_hyperbf_tiny', depth=2, img_size=32, patch_size=4, num_classes=10)
    run = tmp_path / 'run'
    run.mkdir()
    for epoch, name in ((1, 'model_best.pth.tar'), (3, 'last.pth.tar')):  # the best by a metric, the last
        torch.save({'state_dict': model.state_dict(), 'arch': 'vit_hyperbf_tiny', 'epoch': epoch}, run / name)
    args = dict(model='vit_hyperbf_tiny', model_kwargs=dict(depth=2, img_size=32, patch_size=4), img_size=32,
                crop_pct=1.0, num_classes=10, **CIFAR10_NORM)
    (run / 'args.yaml').write_text(yaml.safe_dump(args))
    return run / 'last.pth.tar'


class Logits(torch.nn.Module):
    """A stand-in model whose logits for the n-th image of the run are ``table[n]``."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table, self.seen = table, 0

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        out = self.table[self.seen:self.seen + len(images)]
        self.seen += len(images)
        return out


def test_compare_counts_top1_changed_predictions_and_the_largest_logit_difference(script):
    targets = torch.tensor([0, 1, 2, 0, 1, 2])
    reference = torch.eye(3)[torch.tensor([0, 1, 2, 0, 0, 0])] * 2.  # right on the first four
    other = reference.clone()
    other[4] = torch.tensor([0., 3., 0.])  # now right: changed
    other[5] = torch.tensor([2.5, 0., 0.])  # still class 0, logit moved by 0.5
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(6, 1), targets), batch_size=4)
    results = script.compare({'reference': Logits(reference), 'other': Logits(other)}, loader)
    assert results['reference'] == dict(top1=66.67, changed_predictions=0, changed_percent=0., max_logit_difference=0.)
    assert results['other'] == dict(top1=83.33, changed_predictions=1, changed_percent=16.67, max_logit_difference=3.)


def test_push_rounding_keeps_the_widths_exact_and_rounds_the_rest(script, checkpoint):
    from timm_hbf.hub import FLOAT32_PARAM_NAMES, read_train_output
    train = read_train_output(checkpoint)
    exact = dict(train.create_model().named_parameters())
    pushed = dict(script.stored_as(train.create_model(), torch.bfloat16, FLOAT32_PARAM_NAMES).named_parameters())
    rounded = dict(script.stored_as(train.create_model(), torch.bfloat16, ()).named_parameters())
    widths = [name for name in exact if name.endswith('.log_gamma')]
    assert widths and all(p.dtype == torch.float32 for p in (*pushed.values(), *rounded.values()))
    for name, param in exact.items():
        as_bf16 = param.detach().bfloat16().float()
        assert torch.equal(pushed[name], param if name in widths else as_bf16), name
        assert torch.equal(rounded[name], as_bf16), name
    assert any(not torch.equal(exact[name], rounded[name]) for name in widths)


def test_the_record_on_real_images(script, checkpoint, cifar10_sample, tmp_path):
    out = tmp_path / 'storage.json'
    record = script.main([str(checkpoint.parent), '--data', str(cifar10_sample), '--images', '40', '--out', str(out)])
    written = json.loads(out.read_text())
    assert written['results'] == record['results']
    assert (written['model'], written['checkpoint'], written['epoch'], written['images']) == \
        ('vit_hyperbf_tiny', 'last.pth.tar', 3, 40)  # a folder stands for its last checkpoint
    assert written['data_config']['input_size'] == [3, 32, 32]
    float32, pushed, rounded, autocast = written['results'].values()
    assert list(written['results'])[-1] == 'float32, bfloat16 autocast'
    assert float32['changed_predictions'] == 0 and float32['max_logit_difference'] == 0.
    for variant in (pushed, rounded, autocast):
        assert 0. < variant['max_logit_difference'] < 1.
    assert record['command'].startswith('python benchmarks/storage_dtype.py') and record['versions']['timm']


def test_pretrained_weights_as_stored_and_under_autocast(script, cifar10_sample):
    record = script.main(['--pretrained', 'vit_hyperbf_nrbf_tiny.cifar10_100ep', '--data', str(cifar10_sample),
                          '--images', '20'])
    assert (record['model'], record['checkpoint'], record['images']) == ('vit_hyperbf_nrbf_tiny.cifar10_100ep',
                                                                        'pretrained', 20)
    float32, autocast = record['results'].values()
    assert list(record['results']) == ['float32', 'float32, bfloat16 autocast']
    assert float32['top1'] > 50. and 0. < autocast['max_logit_difference'] < 1.


def test_a_data_folder_without_the_split_or_a_missing_checkpoint_is_refused(script, checkpoint, cifar10_sample,
                                                                              tmp_path):
    with pytest.raises(SystemExit, match='ImageFolder dataset with a test/ folder'):
        script.main([str(checkpoint), '--data', str(tmp_path)])
    with pytest.raises(SystemExit, match='nothing.pth.tar'):
        script.main([str(tmp_path / 'nothing.pth.tar'), '--data', str(cifar10_sample)])
    with pytest.raises(SystemExit, match=r'Name a train.py checkpoint .* or --pretrained'):
        script.main(['--data', str(cifar10_sample)])
