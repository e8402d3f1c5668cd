"""benchmarks/gpu.py: the stages of the GPU work, rehearsed end to end on the CPU with ``--quick``.

timm's train.py and validate.py are not installed with timm, and the speed benchmarks take minutes even at tiny
sizes, so the pipeline runs here with stand-ins that record their arguments and write what the real scripts write:
train.py (``args.yaml``, ``summary.csv``, a real checkpoint of the model it was asked for), validate.py (the results
JSON), throughput.py and attention.py (their JSON, Markdown and plot). Everything else is real: accuracy.py drives
the runs in background processes, ``timm-hbf push --dry-run --dtype bfloat16`` writes the weights, pytest runs a
test module, and the packed files are unpacked and loaded with timm.
"""
import json
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import load_file

from tests.helpers import load_module

ROOT = Path(__file__).resolve().parents[2]
MINI = ROOT.parent / 'shared' / 'datasets' / 'cifar10-mini-jpeg.tar.gz'  # ../shared/datasets/ from the repo root
CIFAR10_LABELS = ['airplane', 'automobile', 'bird', 'cat', 'deer', 'dog', 'frog', 'horse', 'ship', 'truck']
TEST_TOP1 = {'vit_tiny_patch16_224': 50.0, 'vit_hyperbf_tiny': 49.5}  # what the stand-in validate.py reports

FAKE_TRAIN = '''
import argparse, ast, json, sys
from pathlib import Path
import timm, torch, yaml
parser = argparse.ArgumentParser()
for flag in ('-c', '--data-dir', '--train-split', '--val-split', '--output', '--experiment', '--device', '--epochs',
             '--batch-size', '--workers', '--amp-dtype'):
    parser.add_argument(flag)
parser.add_argument('--amp', action='store_true')
parser.add_argument('--pin-mem', action='store_true')
parser.add_argument('--model-kwargs', nargs='*')
args = parser.parse_args()
recipe = yaml.safe_load(Path(args.c).read_text())
kwargs = dict(recipe.get('model_kwargs') or {})
if args.model_kwargs is not None:  # as train.py: the command line's replace the recipe's
    kwargs = {k: ast.literal_eval(v) for k, v in (kv.split('=', 1) for kv in args.model_kwargs)}
trained = dict(recipe, model_kwargs=kwargs, device=args.device or 'cuda', epochs=int(args.epochs or recipe['epochs']))
out = Path(args.output) / args.experiment
out.mkdir(parents=True)
(out / 'argv.json').write_text(json.dumps(sys.argv[1:]))
(out / 'args.yaml').write_text(yaml.safe_dump(trained))
model = timm.create_model(trained['model'], num_classes=trained['num_classes'], **kwargs)
torch.save(dict(arch=trained['model'], epoch=trained['epochs'] - 1, state_dict=model.state_dict(),
                state_dict_ema=model.state_dict()), out / 'model_best.pth.tar')
rows = ''.join(f'{e},2.0,1.9,{20 + 10 * e},60.0,0.001\\n' for e in range(trained['epochs']))
(out / 'summary.csv').write_text('epoch,train_loss,eval_loss,eval_top1,eval_top5,lr\\n' + rows)
'''

FAKE_VALIDATE = f'''
import json, sys
from pathlib import Path
argv = sys.argv[1:]
top1 = {TEST_TOP1!r}.get(argv[argv.index('--model') + 1], 40.0)
Path(argv[argv.index('--results-file') + 1]).write_text(json.dumps({{'top1': top1, 'argv': argv}}))
'''

FAKE_THROUGHPUT = '''
import json, sys
from pathlib import Path
argv = sys.argv[1:]
after = argv[argv.index('--models') + 1:]
models = after[:next((i for i, a in enumerate(after) if a.startswith('--')), len(after))]

def entry(ratio, ceiling, roofline):
    e = dict(spec={}, macs=1, ceiling=ceiling, eager=dict(throughput_ratio=ratio, roofline=roofline, rounds=[1.]))
    if '--compiled' in argv:
        e['compiled'] = dict(throughput_ratio=ratio - 0.02, roofline=roofline, rounds=[1.])
    return e

results = [dict(model=m, input='32/4', mode=mode, batch_size=int(argv[argv.index('--batch-size') + 1]),
                models={m: entry(*((0.96, 1., 1.) if 'hyperbf' in m else (0.74, 0.8, 0.7))),
                        'timm ViT': entry(1., 1., 1.)})
           for m in models for mode in ('infer', 'train')]
path = Path(argv[argv.index('--json') + 1])
path.parent.mkdir(parents=True, exist_ok=True)
path.write_text(json.dumps(dict(environment=dict(command=' '.join(argv)), results=results)))
path.with_suffix('.md').write_text('| the table |\\n')
'''

FAKE_ATTENTION = '''
import json, sys
from pathlib import Path
argv = sys.argv[1:]
contenders = {'timm Attention': dict(reference='timm Attention', ratio=1.),
              'HyperBFAttention': dict(reference='timm Attention', ratio=0.85),
              'HyperBFAttention, compiled': dict(reference='timm Attention, compiled', ratio=0.93)}
path = Path(argv[argv.index('--json') + 1])
path.parent.mkdir(parents=True, exist_ok=True)
path.write_text(json.dumps(dict(environment=dict(command=' '.join(argv)),
                                results=[dict(tokens=256, batch=256, mode='train', contenders=contenders)])))
'''

FAKE_CUDA_TESTS = '''
import os
import pytest


def test_runs_on_the_device_the_stage_names():
    assert os.environ['TIMM_HBF_TEST_DEVICE'] == 'cpu'


@pytest.mark.skip(reason='stands for a test of CUDA kernels')
def test_of_cuda_kernels():
    pass
'''


def load_gpu():
    return load_module(ROOT / 'benchmarks' / 'gpu.py')


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def gpu(tmp_path, monkeypatch):
    """benchmarks/gpu.py with stand-ins for the benchmarks and the CUDA tests, and a folder with train.py and
    validate.py stand-ins (``gpu.scripts``)."""
    module = load_gpu()
    monkeypatch.setattr(module, 'THROUGHPUT', write(tmp_path / 'fakes' / 'throughput.py', FAKE_THROUGHPUT))
    monkeypatch.setattr(module, 'ATTENTION', write(tmp_path / 'fakes' / 'attention.py', FAKE_ATTENTION))
    monkeypatch.setattr(module, 'CUDA_TESTS', write(tmp_path / 'fakes' / 'test_cuda_fake.py', FAKE_CUDA_TESTS))
    write(tmp_path / 'scripts' / 'train.py', FAKE_TRAIN)
    write(tmp_path / 'scripts' / 'validate.py', FAKE_VALIDATE)
    module.scripts = tmp_path / 'scripts'
    return module


def tar_names(path: Path):
    with tarfile.open(path) as tar:
        return {m.name.removeprefix('./'): m for m in tar.getmembers()}


@pytest.mark.skipif(not MINI.exists(), reason=f'mini CIFAR-10 archive not found at {MINI}')
def test_the_quick_pipeline_runs_every_stage_and_packs_what_the_device_tool_brings_back(gpu, tmp_path):
    work, out = tmp_path / 'work', tmp_path / 'out'
    assert gpu.main(['all', '--quick', '--work', str(work), '--scripts', str(gpu.scripts), '--pack-dir', str(out),
                     '--runs', 'memo143-vit_hyperbf', 'modern-vit', 'modern-vit_hyperbf']) == 0
    results = work / 'results'

    env = json.loads((results / 'env.json').read_text())
    assert env['device'].startswith('CPU') and env['torch'] == torch.__version__ and env['timm'] == timm.__version__
    assert 'cuda' in env and env['date'] and env['command'].startswith('python benchmarks/gpu.py all --quick')

    tests = json.loads((results / 'tests' / 'run.json').read_text())
    assert tests['counts'] == dict(tests=2, failures=0, errors=0, skipped=1)  # the test that checks the device passed
    assert tests['rehearsal_on_cpu'] and tests['environment']['device'] == env['device']
    assert 'stands for a test of CUDA kernels' in (results / 'tests' / 'cuda_tests.log').read_text()

    (speed_step,) = json.loads((results / 'speed' / 'run.json').read_text())['steps']
    assert speed_step['status'] == 'ok'
    assert {'--device', 'cpu', '--amp', '--mixer'} <= set(speed_step['command'])
    assert '--compiled' not in speed_step['command']
    targets = (results / 'speed_targets.md').read_text()
    assert '| HyperBF >= 0.95x the ViT | `vit_hyperbf_tiny` 32/4, batch 2, eager | train | 0.960 | yes |' in targets
    assert ('| QIMIA >= 0.9x its arithmetic ceiling (0.80x the ViT) | `vit_qimia_tiny` 32/4, batch 2, eager | infer | '
            '0.925 | yes |') in targets
    assert ('| QIMIA >= 0.9x its roofline (0.70x the ViT) | `vit_qimia_tiny` 32/4, batch 2, eager | infer | '
            '1.057 | yes |') in targets
    assert ("| attention layer >= 0.9x timm's Attention | HyperBFAttention, 256 tokens x 256 | train | 0.850 | "
            "**no** |") in targets

    # the runs: the recipe's model kwargs with the rehearsal's depth, on the CPU, through train.py and validate.py
    runs = results / 'accuracy'
    vit_argv = json.loads((runs / 'modern-vit' / 'runs' / 'cifar10-modern-vit' / 'argv.json').read_text())
    assert vit_argv[vit_argv.index('--model-kwargs'):][:4] == ['--model-kwargs', 'img_size=32', 'patch_size=4',
                                                              'depth=2']
    assert {'--device', 'cpu', '--amp'} <= set(vit_argv) and vit_argv[vit_argv.index('--epochs') + 1] == '1'
    memo = json.loads((runs / 'memo143-vit_hyperbf' / 'runs' / 'cifar10-memo143-vit_hyperbf' / 'argv.json').read_text())
    assert memo[memo.index('--model-kwargs'):][:2] == ['--model-kwargs', 'depth=1']
    modern = json.loads((runs / 'accuracy_modern.json').read_text())
    assert modern['environment']['device'] == env['device'] and modern['command'] == env['command']
    by_name = {r['name']: r for r in modern['runs']}
    assert set(by_name) == {'modern-vit', 'modern-vit_hyperbf'}
    hyperbf = by_name['modern-vit_hyperbf']
    assert (hyperbf['state'], hyperbf['epochs_done'], hyperbf['test_top1']) == ('finished', 1, 49.5)
    assert hyperbf['test_ratio_to_vit'] == pytest.approx(0.99)
    assert [e['eval_top1'] for e in hyperbf['epochs']] == [20.]
    assert hyperbf['versions']['torch'] == torch.__version__ and 'cuda' in hyperbf['versions']
    assert hyperbf['train_command'] and hyperbf['device'].startswith('CPU')
    table = (runs / 'accuracy_modern.md').read_text()
    assert ('| modern-vit_hyperbf | `vit_hyperbf_tiny` | finished | 1/1 | 20.00 | 0 | 49.50 | 0.990 | >= 94.0 %, >= '
            '0.99x ViT |') in table
    assert 'JPEG' in table
    assert '| memo143-vit_hyperbf | `vit_hyperbf_memo143_patch4_32` | finished | 1/1 | 20.00 | 0 | 40.00 |  | 75.12 |' \
        in (runs / 'accuracy_memo143.md').read_text()
    assert (runs / 'accuracy_modern.png').read_bytes()[:4] == b'\x89PNG'
    assert '| modern-vit | finished | 1/1 | 20.00 |' in (runs / 'status.md').read_text()

    # Hub-ready weights of the modern recipe's runs only, in bf16
    made = {w['name']: w for w in json.loads((results / 'weights' / 'run.json').read_text())['weights']}
    assert set(made) == {'vit_tiny_patch4_32.c10', 'vit_hyperbf_tiny.c10'}
    assert made['vit_hyperbf_tiny.c10']['repo_id'] == 'ORG/vit_hyperbf_tiny.c10'
    assert made['vit_hyperbf_tiny.c10']['test_top1'] == 49.5
    folder = work / 'weights' / 'vit_hyperbf_tiny.c10'
    assert {t.dtype for t in load_file(folder / 'model.safetensors').values()} == {torch.bfloat16}
    assert json.loads((folder / 'config.json').read_text())['label_names'] == CIFAR10_LABELS
    assert 'ORG/vit_hyperbf_tiny.c10' in (folder / 'README.md').read_text()

    # packed: within the device tool's limits, no checkpoint and no link
    packed = sorted(p.name for p in out.iterdir())
    assert packed == ['results.tar.gz', 'weights-vit_hyperbf_tiny.c10.tar', 'weights-vit_tiny_patch4_32.c10.tar']
    assert all((out / name).stat().st_size < 16 * 2 ** 20 for name in packed)
    members = tar_names(out / 'results.tar.gz')
    assert {'env.json', 'tests/cuda_tests.log', 'speed/quick.json', 'attention/attention.json',
            'accuracy/accuracy_modern.json', 'accuracy/modern-vit/runs/cifar10-modern-vit/summary.csv',
            'accuracy/modern-vit/runs/cifar10-modern-vit/args.yaml', 'weights/weights.md'} <= set(members)
    assert not [n for n, m in members.items() if n.endswith('.pth.tar') or m.issym()]

    # unpacked here: the results, and weights that timm loads
    assert gpu.main(['unpack', '--from', str(out), '--results-dest', str(tmp_path / 'results'),
                     '--weights-dest', str(tmp_path / 'weights')]) == 0
    assert json.loads((tmp_path / 'results' / 'accuracy' / 'accuracy_modern.json').read_text()) == modern
    model = timm.create_model(f"local-dir:{tmp_path / 'weights' / 'vit_hyperbf_tiny.c10'}", pretrained=True)
    assert model.pretrained_cfg['label_names'] == CIFAR10_LABELS and model.blocks[0].attn.qkv.weight.dtype == \
        torch.float32


def test_gpu_commands_ask_for_cuda_bf16_compile_and_the_issues_batch_sizes(gpu, tmp_path):
    assert gpu.main(['speed', 'attention', '--work', str(tmp_path), '--speed-cases', 'hyperbf32', 'qimia224']) == 0
    speed = [s['command'] for s in json.loads((tmp_path / 'results' / 'speed' / 'run.json').read_text())['steps']]
    for command, model, batch in zip(speed, ['vit_hyperbf_tiny', 'vit_qimia_tiny_patch16_224'], ['1024', '256']):
        assert {'--device', 'cuda', '--amp', '--compiled', '--mixer'} <= set(command)
        assert command[command.index('--models') + 1] == model and command[command.index('--batch-size') + 1] == batch
    (attention,) = json.loads((tmp_path / 'results' / 'attention' / 'run.json').read_text())['steps']
    assert ' '.join(attention['command']).endswith(
        '--device cuda --amp --compiled --backends flash efficient cudnn --flex --json '
        f"{tmp_path / 'results' / 'attention' / 'attention.json'}")
    targets = (tmp_path / 'results' / 'speed_targets.md').read_text()
    assert '| `vit_hyperbf_tiny` 32/4, batch 1024, compiled | infer | 0.940 | **no** |' in targets


def test_training_runs_share_the_machine(gpu, tmp_path):
    """100 epochs in bf16 with pinned memory; the default runs' data-loader workers add up to 14 of the 16 cores;
    model kwargs go to train.py only where a run adds to its recipe's (train.py's replace the recipe's)."""
    ctx = gpu.Context(gpu.parse_args(['status', '--work', str(tmp_path)]))
    assert sum(gpu.RUNS[name].workers for name in gpu.DEFAULT_RUNS) == 14
    assert gpu.train_args(ctx, gpu.RUNS['modern-vit']) == [
        '--epochs', '100', '--workers', '3', '--amp', '--amp-dtype', 'bfloat16', '--pin-mem']
    assert gpu.train_args(ctx, gpu.RUNS['modern-vit_qimia-key_norm'])[-2:] == ['--model-kwargs', 'key_norm=True']
    assert gpu.train_args(ctx, gpu.RUNS['memo143-vit'])[:2] == ['--epochs', '100']


@pytest.mark.parametrize('model, kwargs, run, name', [
    ('vit_tiny_patch16_224', dict(img_size=32, patch_size=4), 'modern-vit', 'vit_tiny_patch4_32.c10'),
    ('vit_hyperbf_tiny', {}, 'modern-vit_hyperbf', 'vit_hyperbf_tiny.c10'),
    ('vit_qimia_tiny', dict(key_norm=True), 'modern-vit_qimia-key_norm', 'vit_qimia_tiny.c10_key_norm'),
])
def test_weights_are_named_by_model_patch_size_dataset_and_option(gpu, model, kwargs, run, name):
    assert gpu.hub_name(dict(model=model, model_kwargs=kwargs), gpu.RUNS[run]) == name


@pytest.mark.skipif(not MINI.exists(), reason=f'mini CIFAR-10 archive not found at {MINI}')
def test_a_failed_run_is_reported_with_the_end_of_its_log(gpu, tmp_path, capsys):
    write(gpu.scripts / 'train.py', 'import sys\nprint("out of memory, say")\nsys.exit(3)\n')
    assert gpu.main(['accuracy', '--quick', '--work', str(tmp_path / 'work'), '--scripts', str(gpu.scripts),
                     '--runs', 'modern-vit']) == 1
    out = capsys.readouterr().out
    assert '| modern-vit | failed | 0/? |' in out
    assert 'modern-vit failed; the end of its log:' in out and 'out of memory, say' in out


def test_budget_ends_a_subprocess_in_time_for_pack(gpu, tmp_path):
    ctx = gpu.Context(gpu.parse_args(['pack', '--work', str(tmp_path), '--budget', str(gpu.PACK_RESERVE + 2)]))
    start = time.monotonic()
    step = gpu.run_logged(ctx, [sys.executable, '-c', 'import time; print("started", flush=True); time.sleep(60)'],
                          tmp_path / 'results' / 'sleep.log')
    assert time.monotonic() - start < 20
    assert step['status'] == 'ended by --budget'
    log = (tmp_path / 'results' / 'sleep.log').read_text()
    assert log.startswith('started') and '--budget ran out' in log


def test_pack_refuses_files_the_device_tool_would_not_bring_back(gpu, tmp_path, capsys):
    (tmp_path / 'work' / 'weights' / 'huge').mkdir(parents=True)
    (tmp_path / 'work' / 'weights' / 'huge' / 'model.safetensors').write_bytes(b'\0' * (16 * 2 ** 20 + 1))
    assert gpu.main(['pack', '--work', str(tmp_path / 'work'), '--pack-dir', str(tmp_path / 'out')]) == 1
    assert 'too big: weights-huge.tar' in capsys.readouterr().out


def test_prepare_fills_the_carried_folder(gpu, tmp_path, monkeypatch, capsys):
    checkout = tmp_path / 'pytorch-image-models'
    write(checkout / 'train.py', '# train.py\n')
    write(checkout / 'validate.py', '# validate.py\n')
    archive = write(tmp_path / 'cifar10.tar.gz', 'an archive')
    monkeypatch.setattr(gpu, 'GPU_DIR', tmp_path / '.gpu')
    assert gpu.main(['prepare', '--work', str(tmp_path / 'work'), '--timm-repo', str(checkout), '--dataset',
                     str(archive), '--timm-wheel', '']) == 0
    assert sorted(p.name for p in (tmp_path / '.gpu').iterdir()) == ['cifar10-jpeg.tar.gz', 'train.py', 'validate.py']
    assert (tmp_path / '.gpu' / 'train.py').read_text() == '# train.py\n'
    assert 'of the 64 MiB it may' in capsys.readouterr().out
