"""benchmarks/record_runs.py: train.py output folders and their logs, recorded side by side."""
import json
from pathlib import Path

import pytest
import yaml
from timm.utils import update_summary

from tests.helpers import ROOT, load_module


def train_log(epochs: int, batch_s: float, test_batch_s: float) -> str:
    """A log as train.py writes it for 3 training and 2 test batches per epoch, launched and resumed once."""
    lines = ['=== start 2026-11-25T13:00:00Z', '=== command: python train.py -c short.yaml --model M']
    for epoch in range(epochs):
        if epoch == 1:  # killed, then resumed: the epoch starts over
            lines += [f'Train: {epoch} [   0/3 (  0%)]  Loss: 2.0 (2.0)  Time: 9.000s,   1.00/s  (9.000s,    1.00/s)',
                      '=== start 2026-11-25T15:00:00Z',
                      '=== command: python train.py -c short.yaml --model M --resume x']
        for i in range(3):
            lines.append(f'Train: {epoch} [{i:>4d}/3 ({i * 33:>3d}%)]  Loss: 2.00 (2.10)  Time: {batch_s:.3f}s,   '
                         f'10.87/s  ({batch_s:.3f}s,    8.19/s)  LR: 2.638e-04  Data: 0.010 (0.023)')
        for i in range(2):
            lines.append(f'Test: [{i:>4d}/1]  Time: {test_batch_s:.3f} ({test_batch_s:.3f})  Loss:   1.000 ( 1.000)  '
                         'Acc@1:  50.000 ( 50.000)  Acc@5:  90.000 ( 90.000)')
    return '\n'.join(lines + ['=== end 2026-11-25T16:00:00Z rc=0']) + '\n'


def make_run(root: Path, model: str, top1: list, batch_s: float) -> Path:
    run = root / model
    run.mkdir(parents=True)
    (run / 'args.yaml').write_text(yaml.safe_dump(dict(model=model, epochs=len(top1), lr_base=2e-3, seed=42)))
    for epoch, acc in enumerate(top1):
        if epoch == 1:  # killed after its summary row and before its checkpoint; train.py resumed writes a header
            update_summary(epoch, dict(loss=3.), dict(loss=1., top1=0., top5=0.), run / 'summary.csv')
        update_summary(epoch, dict(loss=2.), dict(loss=1., top1=acc, top5=90.), run / 'summary.csv',
                       write_header=epoch <= 1)
    (root / f'{model}.log').write_text(train_log(len(top1), batch_s, 0.5))
    return run


def test_runs_are_recorded_with_their_last_epoch_and_their_times(tmp_path):
    runs = [make_run(tmp_path, 'vit_tiny_patch16_224', [40., 60., 70.], 2.),
            make_run(tmp_path, 'hbf', [45., 72., 63.], 4.)]
    result = load_module(ROOT / 'benchmarks' / 'record_runs.py').main(
        [*map(str, runs), '--baseline', 'vit_tiny_patch16_224', '--out', str(tmp_path / 'out')])

    vit, hbf = result['runs']
    assert hbf['test_top1'] == 63.  # the last epoch, not the best one
    assert [e['eval_top1'] for e in hbf['epochs']] == [45., 72., 63.]  # the resumed epoch's row of its second run
    assert [e['seconds'] for e in hbf['epochs']] == [13., 13., 13.]  # 3 x 4 s of training, 2 x 0.5 s of test
    assert hbf['cpu_hours'] == pytest.approx(39. / 3600.)
    assert hbf['started'] == ['2026-11-25T13:00:00Z', '2026-11-25T15:00:00Z'] and len(hbf['commands']) == 2
    assert result['versions']['torch'] and result['machine']['cpu']
    assert json.loads((tmp_path / 'out' / 'runs.json').read_text())['runs'][0]['model'] == 'vit_tiny_patch16_224'
    assert (tmp_path / 'out' / 'runs.png').stat().st_size > 0


def test_an_epochs_time_holds_the_ema_weights_test_pass_too():
    """train.py --model-ema tests the weights, then the EMA weights (``Test (EMA):``)."""
    log = train_log(1, 2., 0.5).splitlines()
    tests = [line for line in log if line.startswith('Test:')]
    log.insert(log.index(tests[-1]) + 1, '\n'.join(line.replace('Test:', 'Test (EMA):').replace('0.500', '0.750')
                                                    for line in tests))
    seconds = load_module(ROOT / 'benchmarks' / 'record_runs.py').epoch_seconds('\n'.join(log))
    assert seconds == {0: 3 * 2. + 2 * 0.5 + 2 * 0.75}


def test_a_folder_without_summary_or_log_is_named(tmp_path):
    (tmp_path / 'run').mkdir()
    with pytest.raises(SystemExit, match='run: expected a train.py output folder with summary.csv'):
        load_module(ROOT / 'benchmarks' / 'record_runs.py').main([str(tmp_path / 'run'), '--out', str(tmp_path)])


def test_a_run_whose_name_holds_a_decimal_point_is_read_with_its_own_log(tmp_path):
    run = make_run(tmp_path, 'hbf+attn_gamma_init=0.25', [45., 50.], 1.)
    result = load_module(ROOT / 'benchmarks' / 'record_runs.py').main(
        [str(run), '--baseline', 'hbf+attn_gamma_init=0.25', '--out', str(tmp_path / 'out')])
    assert result['runs'][0]['test_top1'] == 50.
