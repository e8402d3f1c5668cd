"""benchmarks/race.py: the CPU accuracy race writes every run, mean +- std over seeds and the ratio to the ViT."""
import json
from pathlib import Path

import pytest
import torch

from tests.helpers import load_module

ROOT = Path(__file__).resolve().parents[2]
MINI = ROOT.parent / 'shared' / 'datasets' / 'cifar10-mini-jpeg.tar.gz'


def load_race():
    return load_module(ROOT / 'benchmarks' / 'race.py')


def test_summary_is_mean_and_sample_std_over_seeds_with_the_ratio_to_the_vit():
    race = load_race()
    runs = [dict(name=name, top1=top1, val_top1=val, train_s=seconds) for name, top1, val, seconds in [
        ('vit', 40., 42., 10.), ('vit', 44., 46., 12.), ('qimia', 41., 40., 20.), ('qimia', 45., 44., 22.)]]
    summary = race.summarise(runs)
    assert (summary['vit']['top1']['mean'], summary['vit']['top1']['std']) == (42., pytest.approx(2 ** .5 * 2))
    assert summary['qimia']['top1']['ratio'] == pytest.approx(43. / 42.)
    assert summary['qimia']['val_top1']['ratio'] == pytest.approx(42. / 44.)
    assert summary['qimia']['seeds'] == 2
    table = race.markdown(summary, dict(vit='vit_tiny_patch16_224', qimia='vit_qimia_tiny'))
    assert '| qimia | `vit_qimia_tiny` | 2 | 42.00 ± 2.83 | 43.00 ± 2.83 | 1.024 | 21 |' in table


@pytest.mark.skipif(not MINI.exists(), reason=f'mini CIFAR-10 archive not found at {MINI}')
def test_race_on_the_mini_set_writes_json_markdown_and_plot(tmp_path):
    threads = torch.get_num_threads()
    try:
        record = load_race().main([
            '--contenders', 'vit', 'qimia', '--depth', '1', '--seeds', '0', '1', '--epochs', '1',
            '--train-images', '64', '--val-images', '50', '--test-images', '20', '--threads', '1',
            '--data', str(MINI), '--cache-dir', str(tmp_path / 'cache'), '--out', str(tmp_path / 'out'),
        ])
    finally:
        torch.set_num_threads(threads)
    saved = json.loads((tmp_path / 'out' / 'race.json').read_text())
    assert saved['runs'] == json.loads(json.dumps(record['runs']))
    assert [(r['name'], r['seed']) for r in saved['runs']] == [('vit', 0), ('qimia', 0), ('vit', 1), ('qimia', 1)]
    assert saved['setup']['models'] == dict(vit='vit_tiny_patch16_224', qimia='vit_qimia_tiny')
    assert {'torch', 'timm', 'timm_hbf'} <= set(saved['versions']) and saved['device'].startswith('CPU')
    # accuracies over the 50 validation and 20 test images: whole multiples of 2 % and 5 %
    assert all(r['val_top1'] % 2 == 0 and r['top1'] % 5 == 0 for r in saved['runs'])
    assert '| qimia | `vit_qimia_tiny` | 2 |' in (tmp_path / 'out' / 'race.md').read_text()
    assert (tmp_path / 'out' / 'race.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
