"""Each script of benchmarks/ runs on the tiniest input and writes the JSON record it promises."""
import json
import textwrap

import pytest
import timm
import torch
import yaml
from timm.utils import update_summary

from tests.helpers import ROOT, load_module


@pytest.fixture
def run(monkeypatch):
    """``run('NAME', *argv)``: ``benchmarks/NAME.py``'s ``main(argv)``, its folder on ``sys.path`` (the scripts import
    one another by file name, as they do when run from there) and torch's thread count restored."""
    monkeypatch.syspath_prepend(str(ROOT / 'benchmarks'))
    threads = torch.get_num_threads()
    yield lambda name, *argv: load_module(ROOT / 'benchmarks' / f'{name}.py').main(list(map(str, argv)))
    torch.set_num_threads(threads)


@pytest.mark.slow  # measures the memory of a step in fresh processes
def test_throughput(run, tmp_path):
    out = tmp_path / 'speed.json'
    run('throughput', '--models', 'vit_hyperbf_tiny', 'vit_attnres_tiny', '--model-kwargs', 'depth=1', '--batch-size',
        '2', '--warmup', '0', '--steps', '1', '--rounds', '1', '--threads', '1', '--modes', 'infer', '--json', out)
    record = json.loads(out.read_text())
    assert {'command', 'device', 'torch', 'timm', 'date'} <= set(record['environment'])
    (row,) = record['results']  # models of one shape share their baseline
    assert row['mode'] == 'infer' and list(row['models']) == ['vit_hyperbf_tiny', 'vit_attnres_tiny', 'timm ViT']
    for entry in row['models'].values():
        assert entry['eager']['rounds'][0] > 0 and entry['eager']['peak_mib'] > 0 and entry['macs'] > 0
    assert (tmp_path / 'speed.md').is_file()


def test_head_padding(run, tmp_path):
    out = tmp_path / 'padding.json'
    run('head_padding', '--batch-size', '2', '--rounds', '1', '--steps', '1', '--warmup', '0', '--json', out)
    record = json.loads(out.read_text())
    assert record['attention_shape'] == [2, 3, 65, 64]  # vit_hyperbf_tiny: 3 heads of 64, 64 patches and a class token
    assert set(record['time_ratio']) == {'infer', 'train'} and record['time_ratio']['train']['median'] > 0
    # the padded call keeps q, k, v and the output 7 channels wider (72 against 65)
    saved = record['saved_bytes']
    assert saved['attention, padded'] - saved['attention, unpadded'] == 4 * 7 * 2 * 3 * 65 * 4
    assert 0 < record['padding_share_of_training_memory'] < 1


def test_storage_dtype(run, cifar10_sample, tmp_path):
    torch.manual_seed(0)
    model = timm.create_model('vit_hyperbf_tiny', depth=1)
    torch.save({'state_dict': model.state_dict(), 'arch': 'vit_hyperbf_tiny', 'epoch': 3}, tmp_path / 'last.pth.tar')
    (tmp_path / 'args.yaml').write_text(yaml.safe_dump(dict(model='vit_hyperbf_tiny', model_kwargs=dict(depth=1))))
    out = tmp_path / 'storage.json'
    run('storage_dtype', tmp_path, '--data', cifar10_sample, '--images', '20', '--out', out)
    record = json.loads(out.read_text())
    assert (record['model'], record['checkpoint'], record['epoch'], record['images']) == \
        ('vit_hyperbf_tiny', 'last.pth.tar', 3, 20)  # a folder stands for its last checkpoint
    float32, *half = record['results'].values()
    assert len(half) == 3 and float32['changed_predictions'] == 0 and float32['max_logit_difference'] == 0.
    assert all(0. < variant['max_logit_difference'] < 1. for variant in half)


def test_record_runs(run, tmp_path):
    """A train.py output folder (``args.yaml``, ``summary.csv``) and its log beside it."""
    folder = tmp_path / 'vit_hyperbf_tiny'
    folder.mkdir()
    (folder / 'args.yaml').write_text(yaml.safe_dump(dict(model='vit_hyperbf_tiny', epochs=1)))
    update_summary(0, dict(loss=2.), dict(loss=1., top1=45., top5=90.), folder / 'summary.csv', write_header=True)
    (tmp_path / 'vit_hyperbf_tiny.log').write_text(
        '=== start 2026-11-25T13:00:00Z\n'
        'Train: 0 [   2/3 ( 67%)]  Loss: 2.00 (2.10)  Time: 4.000s,   10.87/s  (4.000s,    8.19/s)\n'
        'Test: [   1/1]  Time: 0.500 (0.500)  Loss:   1.000 ( 1.000)\n')
    run('record_runs', folder, '--out', tmp_path / 'out')
    (recorded,) = json.loads((tmp_path / 'out' / 'runs.json').read_text())['runs']
    assert recorded['test_top1'] == 45. and recorded['started'] == ['2026-11-25T13:00:00Z']
    assert recorded['epochs'][0]['seconds'] == 3 * 4. + 2 * .5  # train.py's mean batch times its batches
    assert (tmp_path / 'out' / 'runs.png').is_file()


# stand-ins for timm's train.py and validate.py (in timm's git repository only): they write what the real ones write
TRAIN = '''
import argparse, sys, torch, yaml
from pathlib import Path
parser = argparse.ArgumentParser()
for flag in ('-c', '--model', '--seed', '--data-dir', '--train-split', '--val-split', '--output', '--experiment'):
    parser.add_argument(flag)
args, _ = parser.parse_known_args()
out = Path(args.output) / args.experiment
out.mkdir(parents=True, exist_ok=True)
recipe = yaml.safe_load(Path(args.c).read_text())
(out / 'args.yaml').write_text(yaml.safe_dump(dict(recipe, model=args.model, device='cpu')))
(out / 'summary.csv').write_text('epoch,eval_top1\\n0,20\\n1,40\\n')
torch.save({'epoch': 1, 'state_dict': {}}, out / 'model_best.pth.tar')
'''
VALIDATE = '''
import json, sys
from pathlib import Path
Path(sys.argv[sys.argv.index('--results-file') + 1]).write_text(json.dumps({'top1': 45.}))
'''


@pytest.mark.slow  # a train.py and a validate.py process a run
def test_accuracy(run, cifar10_sample, tmp_path):
    (tmp_path / 'train.py').write_text(textwrap.dedent(TRAIN))
    (tmp_path / 'validate.py').write_text(textwrap.dedent(VALIDATE))
    out = tmp_path / 'out'
    run('accuracy', '--scripts', tmp_path, '--data', cifar10_sample, '--models', 'vit_hyperbf_tiny',
        'vit_tiny_patch16_224', '--val-per-class', '10', '--out', out)
    record = json.loads((out / 'accuracy.json').read_text())
    assert [(r['model'], r['best_epoch'], r['val_top1'], r['test_top1']) for r in record['runs']] == \
        [('vit_hyperbf_tiny', 1, 40., 45.), ('vit_tiny_patch16_224', 1, 40., 45.)]
    assert record['summary']['vit_hyperbf_tiny']['test_ratio_to_baseline'] == 1.
    assert {'date', 'command', 'device', 'versions', 'recipe'} <= set(record)
    # the validation split is held out of the train images, the test split left as it is
    held_out = {p.name for p in (out / 'data' / 'val' / 'cat').iterdir()}
    assert len(held_out) == 10 and not held_out & {p.name for p in (out / 'data' / 'train' / 'cat').iterdir()}
