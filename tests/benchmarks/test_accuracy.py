"""benchmarks/accuracy.py: train.py runs of our recipes pick their checkpoint on a validation split held out from
train, and validate.py measures it once on the test split.

timm's train.py and validate.py are not installed with timm, so these tests give the driver two stand-ins that
record their arguments and write what the real scripts write (``args.yaml``, ``summary.csv``, a checkpoint, the
results JSON)."""
import json
import textwrap
from pathlib import Path

import pytest
import yaml

from tests.helpers import load_module

ROOT = Path(__file__).resolve().parents[2]
CLASSES = ('cat', 'dog', 'ship')

FAKE_TRAIN = '''
import argparse, json, sys
from pathlib import Path
import yaml
parser = argparse.ArgumentParser()
for flag in ('-c', '--data-dir', '--train-split', '--val-split', '--output', '--experiment', '--device', '--epochs'):
    parser.add_argument(flag)
args = parser.parse_args()
trained = dict(yaml.safe_load(Path(args.c).read_text()), device=args.device or 'cuda')
out = Path(args.output) / args.experiment
out.mkdir(parents=True)
(out / 'argv.json').write_text(json.dumps(sys.argv[1:]))
(out / 'args.yaml').write_text(yaml.safe_dump(trained))
(out / 'model_best.pth.tar').write_bytes(b'')
(out / 'summary.csv').write_text(
    'epoch,train_loss,eval_loss,eval_top1,eval_top5,lr\\n0,2.3,2.2,20.0,60.0,0.001\\n1,2.1,2.0,35.5,70.0,0.0005\\n'
    '2,2.0,1.9,30.0,72.0,0.0001\\n')
'''

FAKE_VALIDATE = '''
import json, sys
from pathlib import Path
argv = sys.argv[1:]
Path(argv[argv.index('--results-file') + 1]).write_text(json.dumps({'top1': 33.25, 'argv': argv}))
'''


def load_accuracy():
    return load_module(ROOT / 'benchmarks' / 'accuracy.py')


@pytest.fixture
def dataset(tmp_path) -> Path:
    for split, count in (('train', 10), ('test', 4)):
        for name in CLASSES:
            folder = tmp_path / 'data' / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                (folder / f'{i:03d}.png').write_bytes(b'')
    return tmp_path / 'data'


@pytest.fixture
def scripts(tmp_path) -> Path:
    folder = tmp_path / 'scripts'
    folder.mkdir()
    (folder / 'train.py').write_text(textwrap.dedent(FAKE_TRAIN))
    (folder / 'validate.py').write_text(textwrap.dedent(FAKE_VALIDATE))
    return folder


def test_validation_images_are_held_out_per_class_and_the_test_split_is_untouched(dataset, tmp_path):
    split = load_accuracy().split_data(dataset, tmp_path / 'split', val_per_class=3)
    for name in CLASSES:
        train = {p.name for p in (split / 'train' / name).iterdir()}
        val = {p.name for p in (split / 'val' / name).iterdir()}
        assert len(val) == 3 and len(train) == 7 and not train & val
        assert train | val == {p.name for p in (dataset / 'train' / name).iterdir()}
    assert (split / 'test').resolve() == (dataset / 'test').resolve()


def test_a_run_trains_on_train_chooses_on_val_and_tests_once(dataset, scripts, tmp_path):
    out = tmp_path / 'out'
    record = load_accuracy().main([
        '--scripts', str(scripts), '--data', str(dataset), '--runs', 'cifar10/modern/vit', '--val-per-class', '2',
        '--out', str(out), '--', '--device', 'cpu', '--epochs', '3'])
    run_dir = out / 'runs' / 'cifar10-modern-vit'
    train_argv = json.loads((run_dir / 'argv.json').read_text())
    assert train_argv[train_argv.index('--train-split') + 1] == 'train'
    assert train_argv[train_argv.index('--val-split') + 1] == 'val'
    assert train_argv[-4:] == ['--device', 'cpu', '--epochs', '3']
    assert train_argv[train_argv.index('-c') + 1].endswith('recipes/cifar10/modern/vit.yaml')

    test_argv = json.loads((run_dir / 'test.json').read_text())['argv']
    assert test_argv[test_argv.index('--split') + 1] == 'test'
    assert test_argv[test_argv.index('--checkpoint') + 1] == str(run_dir / 'model_best.pth.tar')
    assert test_argv[test_argv.index('--device') + 1] == 'cpu'
    assert '--use-ema' in test_argv  # the recipe trains with EMA, and train.py picks its best checkpoint on EMA
    kwargs = test_argv[test_argv.index('--model-kwargs') + 1:test_argv.index('--model-kwargs') + 3]
    assert kwargs == ['img_size=32', 'patch_size=4']

    (run,) = record['runs']
    assert (run['val_top1'], run['best_epoch'], run['test_top1']) == (35.5, 1, 33.25)
    assert [e['eval_top1'] for e in run['epochs']] == [20., 35.5, 30.]
    assert json.loads((out / 'accuracy.json').read_text())['runs'][0]['test_top1'] == 33.25
    table = (out / 'accuracy.md').read_text()
    assert '| cifar10/modern/vit | `vit_tiny_patch16_224` | 3 | 35.50 | 1 | 33.25 |' in table
    assert (out / 'accuracy.png').stat().st_size > 0
    assert yaml.safe_load((run_dir / 'args.yaml').read_text())['device'] == 'cpu'


def test_an_existing_run_folder_is_never_appended_to(dataset, scripts, tmp_path):
    (tmp_path / 'out' / 'runs' / 'cifar10-modern-vit').mkdir(parents=True)
    with pytest.raises(SystemExit, match='exists'):
        load_accuracy().main(['--scripts', str(scripts), '--data', str(dataset), '--runs', 'cifar10/modern/vit',
                              '--val-per-class', '2', '--out', str(tmp_path / 'out')])


@pytest.mark.parametrize('problem, match', [
    ('recipe', r'no recipe .*Recipes: .*cifar10/modern/vit_hyperbf'),
    ('scripts', r"no train.py.*git clone"),
    ('data', r'train/ and test/'),
    ('val', r'leaves no training image'),
])
def test_bad_input_names_the_fix(problem, match, dataset, scripts, tmp_path):
    argv = dict(scripts=str(scripts), data=str(dataset), runs='cifar10/modern/vit', val='2')
    argv.update({'recipe': dict(runs='cifar10/modern/vit_nope'), 'scripts': dict(scripts=str(tmp_path)),
                 'data': dict(data=str(dataset / 'train')), 'val': dict(val='10')}[problem])
    with pytest.raises(SystemExit, match=match):
        load_accuracy().main(['--scripts', argv['scripts'], '--data', argv['data'], '--runs', argv['runs'],
                              '--val-per-class', argv['val'], '--out', str(tmp_path / 'out')])
