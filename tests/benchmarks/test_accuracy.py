"""benchmarks/accuracy.py: train.py runs of a recipe choose their checkpoint on a validation split held out from the
train images, validate.py measures it once on the test split, and the table sums up the seeds beside the baseline.

No package on the index ships timm's train.py and validate.py (they are in timm's git repository only), so these
tests give the script two stand-ins that record their arguments and write what the real scripts write
(``args.yaml``, ``summary.csv``, a checkpoint, the results JSON). The tests that run them, a process each, are
slow."""
import argparse
import json
import re
import textwrap
from pathlib import Path

import pytest

from tests.helpers import ROOT, load_module

MODERN = ROOT / 'timm_hbf' / 'recipes' / 'cifar10' / 'modern.yaml'

FAKE_TRAIN = '''
import argparse, json, sys
from pathlib import Path
import torch, yaml
parser = argparse.ArgumentParser()
for flag in ('-c', '--model', '--seed', '--data-dir', '--train-split', '--val-split', '--output', '--experiment',
             '--device', '--epochs', '--resume'):
    parser.add_argument(flag)
args = parser.parse_args()
if args.model == 'vit_attnres_tiny':  # a run that fails
    sys.exit('the run failed')
out = Path(args.output) / args.experiment
out.mkdir(parents=True, exist_ok=True)
(out / 'argv.json').write_text(json.dumps(sys.argv[1:]))
(out / 'args.yaml').write_text(yaml.safe_dump(dict(yaml.safe_load(Path(args.c).read_text()), model=args.model,
                                                   device=args.device or 'cuda')))
best = {'vit_hyperbf_tiny': 36, 'vit_tiny_patch16_224': 40}[args.model] + int(args.seed)
summary = f'epoch,eval_top1\\n0,20\\n1,{best}\\n2,30\\n'
if args.resume:  # resumed at epoch 2: train.py's choice of the best starts afresh, and finds epoch 3
    (out / 'summary.csv').write_text(summary + 'epoch,eval_top1\\n2,31\\n3,32\\n')
    torch.save({'epoch': 3, 'state_dict': {}}, out / 'model_best.pth.tar')
else:  # train.py's checkpoints: the best epoch's, also kept as checkpoint-N among the --checkpoint-hist best
    (out / 'summary.csv').write_text(summary)
    for name in ('model_best.pth.tar', 'checkpoint-1.pth.tar'):
        torch.save({'epoch': 1, 'state_dict': {}}, out / name)
'''

FAKE_VALIDATE = '''
import json, sys
from pathlib import Path
argv = sys.argv[1:]
seed = int(Path(argv[argv.index('--checkpoint') + 1]).parent.name.rsplit('seed', 1)[1])
top1 = {'vit_hyperbf_tiny': 45, 'vit_tiny_patch16_224': 50}[argv[argv.index('--model') + 1]] + seed
Path(argv[argv.index('--results-file') + 1]).write_text(json.dumps({'top1': top1, 'argv': argv}))
'''


@pytest.fixture
def scripts(tmp_path) -> Path:
    folder = tmp_path / 'scripts'
    folder.mkdir()
    (folder / 'train.py').write_text(textwrap.dedent(FAKE_TRAIN))
    (folder / 'validate.py').write_text(textwrap.dedent(FAKE_VALIDATE))
    return folder


def accuracy(*argv: str):
    return load_module(ROOT / 'benchmarks' / 'accuracy.py').main(list(argv))


@pytest.mark.parametrize('train_per_class', [None, 30])
def test_validation_images_are_held_out_per_class_and_the_test_split_is_untouched(train_per_class, cifar10_sample,
                                                                                  tmp_path):
    split_data = load_module(ROOT / 'benchmarks' / 'accuracy.py').split_data
    split_data(cifar10_sample, 'test', tmp_path / 'split', 20)  # a split of other arguments leaves nothing behind
    split = split_data(cifar10_sample, 'test', tmp_path / 'split', 10, train_per_class)
    for class_dir in (cifar10_sample / 'train').iterdir():
        train = {p.name for p in (split / 'train' / class_dir.name).iterdir()}
        val = {p.name for p in (split / 'val' / class_dir.name).iterdir()}
        assert len(val) == 10 and len(train) == (train_per_class or 90) and not train & val
        assert train | val <= {p.name for p in class_dir.iterdir()}
    assert (split / 'test').resolve() == (cifar10_sample / 'test').resolve()


@pytest.mark.slow
def test_runs_train_on_train_choose_on_val_test_once_and_sum_up_the_seeds(cifar10_sample, scripts, tmp_path):
    out = tmp_path / 'out'
    record = accuracy('--scripts', str(scripts), '--data', str(cifar10_sample), '--recipe', str(MODERN),
                      '--models', 'vit_hyperbf_tiny', 'vit_tiny_patch16_224', '--seeds', '0', '2',
                      '--val-per-class', '10', '--jobs', '2', '--out', str(out),
                      '--', '--device', 'cpu', '--epochs', '3')
    run_dir = out / 'runs' / 'vit_hyperbf_tiny-seed2'
    train = json.loads((run_dir / 'argv.json').read_text())
    assert train[train.index('-c') + 1] == str(MODERN) and train[train.index('--model') + 1] == 'vit_hyperbf_tiny'
    assert train[train.index('--seed') + 1] == '2' and train[train.index('--data-dir') + 1] == str(out / 'data')
    assert (train[train.index('--train-split') + 1], train[train.index('--val-split') + 1]) == ('train', 'val')
    assert train[-4:] == ['--device', 'cpu', '--epochs', '3']

    test = json.loads((run_dir / 'test.json').read_text())['argv']
    assert test[test.index('--split') + 1] == 'test'
    assert test[test.index('--checkpoint') + 1] == str(run_dir / 'model_best.pth.tar')
    assert test[test.index('--device') + 1] == 'cpu'
    assert '--use-ema' in test  # the recipe keeps an EMA, on which train.py chose its best checkpoint
    assert test[test.index('--model-kwargs') + 1:][:2] == ['img_size=32', 'patch_size=4']

    runs = {(r['model'], r['seed']): r for r in record['runs']}
    assert (runs['vit_hyperbf_tiny', 2]['val_top1'], runs['vit_hyperbf_tiny', 2]['best_epoch']) == (38, 1)
    assert runs['vit_hyperbf_tiny', 2]['test_top1'] == 47
    hyperbf = record['summary']['vit_hyperbf_tiny']
    assert hyperbf['seeds'] == 2 and hyperbf['test_top1'] == dict(mean=46, std=pytest.approx(2 ** .5))
    assert hyperbf['test_ratio_to_baseline'] == pytest.approx(46 / 51)
    saved = json.loads((out / 'accuracy.json').read_text())
    assert saved['summary'] == json.loads(json.dumps(record['summary'])) and saved['recipe']['model_ema']
    assert {'torch', 'timm', 'timm_hbf'} <= set(saved['versions']) and saved['device'] and saved['date']
    assert (out / 'accuracy.png').read_bytes()[:4] == b'\x89PNG'


@pytest.mark.parametrize('given', [[], ['--model-kwargs', 'img_size=32', 'depth=6', '--epochs', '5']])
def test_a_variant_trains_its_model_with_its_own_arguments_on_top_of_every_runs(given, tmp_path):
    bench = load_module(ROOT / 'benchmarks' / 'accuracy.py')
    args = argparse.Namespace(scripts=str(tmp_path), recipe=str(MODERN), out=str(tmp_path), train_args=given)
    plain = bench.train_command(args, 'vit_qimia_tiny', 0, tmp_path, 'plain')
    assert plain[plain.index('--model') + 1] == 'vit_qimia_tiny' and plain[len(plain) - len(given):] == given
    variant = bench.train_command(args, 'vit_qimia_tiny:keys_from_values=True,depth_num_heads=1', 0, tmp_path, 'v')
    assert variant[variant.index('--model') + 1] == 'vit_qimia_tiny'
    every_runs = ['img_size=32', 'depth=6'] if given else ['img_size=32', 'patch_size=4']  # given, else the recipe's
    assert variant[len(plain):] == ['--model-kwargs', *every_runs, 'keys_from_values=True', 'depth_num_heads=1']


@pytest.mark.slow
def test_a_finished_run_is_read_back_and_one_cut_short_resumes_from_its_last_checkpoint(cifar10_sample, scripts,
                                                                                      tmp_path):
    out = tmp_path / 'out'
    argv = ('--scripts', str(scripts), '--data', str(cifar10_sample), '--models', 'vit_hyperbf_tiny',
            'vit_tiny_patch16_224', '--val-per-class', '10', '--jobs', '2', '--out', str(out))
    first = accuracy(*argv)
    finished, cut_short = out / 'runs' / 'vit_hyperbf_tiny-seed42', out / 'runs' / 'vit_tiny_patch16_224-seed42'
    (finished / 'argv.json').unlink()  # written by train.py: it must not run again
    for checkpoint in finished.glob('*.pth.tar'):  # once tested, a run needs only its records
        checkpoint.unlink()
    (cut_short / 'test.json').unlink()
    (cut_short / 'last.pth.tar').write_bytes(b'checkpoint')
    again = accuracy(*argv)['runs']
    assert again[0] == first['runs'][0]
    assert not (finished / 'argv.json').exists()
    assert json.loads((cut_short / 'argv.json').read_text())[-2:] == ['--resume', str(cut_short / 'last.pth.tar')]
    # the resumed run's best on the validation split is still epoch 1, from before the resume: that checkpoint is tested
    assert (again[1]['best_epoch'], again[1]['val_top1']) == (1, first['runs'][1]['val_top1'])
    assert again[1]['test_command'][again[1]['test_command'].index('--checkpoint') + 1] == \
        str(cut_short / 'checkpoint-1.pth.tar')
    assert [e['eval_top1'] for e in again[1]['epochs']] == [20., first['runs'][1]['val_top1'], 31., 32.]
    (cut_short / 'test_command.json').unlink()  # a folder from before the test command was recorded: its checkpoint
    assert accuracy(*argv)['runs'] == again
    for other in (('--train-per-class', '50'), ('--', '--epochs', '5')):  # not read back as if made so
        with pytest.raises(SystemExit, match=r'vit_hyperbf_tiny-seed42 holds a run of another command or data split '
                                             r'.* remove it or choose another --out'):
            accuracy(*argv, *other)
    assert json.loads((out / 'accuracy.json').read_text())['runs'] == again  # the record stays


@pytest.mark.slow
def test_every_run_logs_to_a_file_of_its_own_even_where_a_variant_holds_a_decimal_point(cifar10_sample, scripts,
                                                                                         tmp_path):
    out = tmp_path / 'out'
    with pytest.raises(SystemExit, match=r'=0\.25-seed42: train.py failed, see .*=0\.25-seed42\.log'):  # the stand-in
        accuracy('--scripts', str(scripts), '--data', str(cifar10_sample), '--models',  # train.py takes no kwargs
                 'vit_hyperbf_tiny:attn_gamma_init=0.25', 'vit_hyperbf_tiny:attn_gamma_init=0.5',
                 '--baseline', 'vit_hyperbf_tiny:attn_gamma_init=0.25', '--val-per-class', '10', '--jobs', '2',
                 '--out', str(out))
    logs = {p.name: p.read_text() for p in (out / 'runs').glob('*.log')}
    assert sorted(logs) == ['vit_hyperbf_tiny+attn_gamma_init=0.25-seed42.log',
                            'vit_hyperbf_tiny+attn_gamma_init=0.5-seed42.log']
    assert 'attn_gamma_init=0.5' in logs['vit_hyperbf_tiny+attn_gamma_init=0.5-seed42.log']
    assert 'attn_gamma_init=0.5' not in logs['vit_hyperbf_tiny+attn_gamma_init=0.25-seed42.log']


@pytest.mark.slow
def test_a_failed_run_is_named_and_the_others_are_kept(cifar10_sample, scripts, tmp_path):
    out = tmp_path / 'out'
    with pytest.raises(SystemExit, match=r'vit_attnres_tiny-seed42: train.py failed, see .*attnres_tiny-seed42.log'):
        accuracy('--scripts', str(scripts), '--data', str(cifar10_sample), '--models', 'vit_attnres_tiny',
                 'vit_hyperbf_tiny', '--val-per-class', '10', '--jobs', '2', '--out', str(out))
    assert [r['model'] for r in json.loads((out / 'accuracy.json').read_text())['runs']] == ['vit_hyperbf_tiny']
    assert 'the run failed' in (out / 'runs' / 'vit_attnres_tiny-seed42.log').read_text()


@pytest.mark.slow
def test_when_every_run_fails_the_record_of_an_earlier_call_stays(cifar10_sample, scripts, tmp_path):
    out = tmp_path / 'out'
    argv = ['--scripts', str(scripts), '--data', str(cifar10_sample), '--val-per-class', '10', '--out', str(out)]
    accuracy(*argv, '--models', 'vit_hyperbf_tiny')
    earlier = {name: (out / name).read_bytes() for name in ('accuracy.json', 'accuracy.md', 'accuracy.png')}
    with pytest.raises(SystemExit, match='vit_attnres_tiny-seed42: train.py failed'):
        accuracy(*argv, '--models', 'vit_attnres_tiny')
    assert {name: (out / name).read_bytes() for name in earlier} == earlier


@pytest.mark.slow
def test_the_split_is_made_anew_only_where_it_holds_links_alone(cifar10_sample, scripts, tmp_path):
    """The script deletes and remakes --out/data: a folder there with a file of its own, or the --data given, is
    refused and left as it was."""
    out = tmp_path / 'out'
    argv = ['--scripts', str(scripts), '--val-per-class', '10', '--models', 'vit_hyperbf_tiny', '--out', str(out)]
    accuracy(*argv, '--data', str(cifar10_sample))
    accuracy(*argv, '--data', str(cifar10_sample))  # its own split: made anew
    mine = out / 'data' / 'train' / 'notes.txt'
    mine.write_text('mine')
    with pytest.raises(SystemExit, match=r'--out: .*data holds files this script did not make \(.*notes.txt\)'):
        accuracy(*argv, '--data', str(cifar10_sample))
    assert mine.read_text() == 'mine' and (out / 'data' / 'test').is_symlink()
    with pytest.raises(SystemExit, match=r'--data .* lies in .*data, where the script writes its split'):
        accuracy(*argv, '--data', str(out / 'data'))
    assert mine.read_text() == 'mine'


def run_with(problem, cifar10_sample, scripts, tmp_path):
    """The script on the sample with one bad input, ``problem``."""
    argv = dict(scripts=scripts, data=cifar10_sample, recipe=MODERN, val='10', model='vit_hyperbf_tiny')
    argv.update({'recipe': dict(recipe=tmp_path / 'nope.yaml'), 'scripts': dict(scripts=tmp_path),
                 'data': dict(data=cifar10_sample / 'train'), 'val': dict(val='100'),
                 'variant': dict(model='vit_qimia_tiny:depth'), 'model': dict(model='vit_qimia_tyni'), 'split': {},
                 'jobs': {}}[problem])
    train_args = ['--', '--val-split', 'test'] if problem == 'split' else []
    train_args = ['--jobs', '0'] if problem == 'jobs' else train_args
    accuracy('--scripts', str(argv['scripts']), '--data', str(argv['data']), '--recipe', str(argv['recipe']),
             '--val-per-class', argv['val'], '--models', argv['model'], '--out', str(tmp_path / 'out'), *train_args)


@pytest.mark.parametrize('problem, message', [
    ('recipe', r'--recipe .*nope.yaml: no such file \(the recipes are in .*recipes\)'),
    ('scripts', r'--scripts .*: no train.py. It is in timm.s git repository: git clone'),
    ('variant', r'--models vit_qimia_tiny:depth: expected NAME or NAME:KEY=VALUE'),
    ('model', r'--models vit_qimia_tyni: timm has no model vit_qimia_tyni \(timm.list_models\(\) lists'),
    ('jobs', r'--jobs must be an integer >= 1, got 0'),
    ('split', r'--val-split after --: the script splits the data itself .* give --data and --test-split'),
])
def test_arguments_it_cannot_run_with_are_usage_errors_that_name_the_fix(problem, message, cifar10_sample, scripts,
                                                                          capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        run_with(problem, cifar10_sample, scripts, tmp_path)
    assert exit_info.value.code == 2
    assert re.search(f'error: {message}', capsys.readouterr().err)
    assert not (tmp_path / 'out').exists()  # nothing split, nothing written


@pytest.mark.parametrize('problem, match', [
    ('data', r'expected an ImageFolder layout with train/ and test/'),
    ('val', r'--val-per-class 100 leaves no training image of class airplane'),
])
def test_data_it_cannot_split_stops_the_script_with_the_fix(problem, match, cifar10_sample, scripts, tmp_path):
    with pytest.raises(SystemExit, match=match):
        run_with(problem, cifar10_sample, scripts, tmp_path)
