"""Issue 23's GPU work from one entry point, in stages that fit commands of at most 10 minutes on a GPU machine with
no package index: the CUDA tests, the speed tables, the 100-epoch CIFAR-10 runs with timm's train.py, and Hub-ready
weights; rehearsed on the CPU at tiny sizes with ``--quick``.

Stages, run in the order given (``all``: env tests speed attention accuracy weights pack):

    env        device, driver, versions (torch, CUDA, cuDNN, timm, ...) into ``results/env.json``
    tests      ``pytest tests/cuda`` into ``results/tests/`` (log, JUnit XML, counts)
    speed      ``benchmarks/throughput.py``, bf16 autocast, eager and ``--compiled``, with timm's ViT and MLP-Mixer:
               one run per case (``--speed-cases``: HyperBF and QIMIA at 32/4, batch 1024, and 224/16, batch 256)
    attention  ``benchmarks/attention.py``: the attention layer alone against timm's ``Attention``, 256 to 4096
               tokens, eager and compiled, each SDPA backend and FlexAttention
    accuracy   starts the runs of ``benchmarks/accuracy.py`` (``--runs``, see ``RUNS``) in the background, each in a
               process session of its own (they outlive the command), several sharing the GPU, their train.py
               ``--workers`` adding up to 14
    status     every run's state, epochs, validation top-1 and time left; ``--wait S`` waits up to S seconds for
               them to finish; then merges them (``results/accuracy/accuracy_<recipe>.{json,md,png}``), the
               papers' numbers and our targets beside them
    weights    ``timm-hbf push --dry-run --dtype bfloat16`` of every finished modern-recipe run: a Hub-ready folder
    pack       what came out, into at most 8 files of at most 16 MiB in ``--pack-dir`` (default ``$OUT``):
               ``results.tar.gz`` (logs, JSON, Markdown, plots; no checkpoints) and ``weights-<name>.tar``
    prepare    (here, before) fills ``.gpu/``: timm's train.py and validate.py, the CIFAR-10 archive, a timm wheel
    unpack     (here, after) puts the packed files into ``benchmarks/results/gpu/`` and ``weights/``

Stages come first on the command line, options after them. Every stage writes ``results/<stage>/run.json``: the
environment, this command, the date, and each command it ran with its exit status and duration. ``--budget S``
ends a command's subprocesses in time for ``pack`` to run within S seconds. State lives in ``--work`` (default
``/tmp/timm_hbf_gpu``, outside the checkout, which each device call sends anew): ``data/``, ``site/`` (the carried
wheels), ``results/``, ``weights/``; ``pack`` always packs all of it, so the last call's files hold everything.

Preparation, here, once (``.gpu/``, about 22 MB, is ignored by git and travels with ``carry``)::

    .venv/bin/python benchmarks/gpu.py prepare --timm-repo /work/.mirror/huggingface+pytorch-image-models/repo
    .venv/bin/python benchmarks/gpu.py all --quick     # the whole pipeline on the CPU at tiny sizes (minutes)

On the GPU machine: device ``run`` calls with ``carry=['.gpu']`` and ``timeout_s=600``, each issued as soon as the
last returns (a machine idle for 30 s is given back, and the background runs with it; copy each call's
``files_at`` aside and unpack at the end). Session A, the accuracy runs, with the CUDA tests beside them (they
check numbers, not speed)::

    python3 benchmarks/gpu.py env accuracy tests status pack --budget 570
    python3 benchmarks/gpu.py status pack --wait 540 --budget 570
    python3 benchmarks/gpu.py status weights pack --wait 480 --budget 570   # --include-unfinished if time ran out

Session B, the speed tables, with the GPU to themselves (one case per call: each compiles 3 models twice over,
in training and inference, and again in the processes that measure memory)::

    python3 benchmarks/gpu.py env speed pack --speed-cases hyperbf32 --budget 570
    python3 benchmarks/gpu.py speed pack --speed-cases hyperbf224 --budget 570
    python3 benchmarks/gpu.py attention pack --budget 570

and qimia32 and qimia224 likewise. Back here: ``.venv/bin/python benchmarks/gpu.py unpack --from <files_at>``
puts the results into ``benchmarks/results/gpu/`` and the weights into ``weights/``.
"""
import argparse
import csv
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import yaml

ROOT = Path(__file__).resolve().parents[1]
GPU_DIR = ROOT / '.gpu'
DATASETS = ROOT.parent / 'shared' / 'datasets'
FULL_ARCHIVE, MINI_ARCHIVE = 'cifar10-jpeg.tar.gz', 'cifar10-mini-jpeg.tar.gz'
RECIPES = ROOT / 'timm_hbf' / 'recipes'
THROUGHPUT, ATTENTION, ACCURACY = (ROOT / 'benchmarks' / f'{name}.py' for name in ('throughput', 'attention',
                                                                                    'accuracy'))
CUDA_TESTS = ROOT / 'tests' / 'cuda'
FILE_LIMIT, FILE_COUNT_LIMIT, TREE_LIMIT = 16 * 2 ** 20, 8, 64 * 2 ** 20  # what the device tool moves
PACK_RESERVE = 30  # seconds --budget keeps for packing
STAGES = ('env', 'tests', 'speed', 'attention', 'accuracy', 'status', 'weights', 'pack', 'prepare', 'unpack')
ALL = ('env', 'tests', 'speed', 'attention', 'accuracy', 'weights', 'pack')


@dataclass(frozen=True)
class Run:
    """One accuracy run: a recipe (DATASET/RECIPE/FAMILY), train.py's data-loader workers, and model kwargs added to
    the recipe's, under a tag."""
    recipe: str
    workers: int
    model_kwargs: Dict[str, object] = field(default_factory=dict)
    tag: str = ''
    quick_depth: int = 2  # blocks in the --quick rehearsal

    @property
    def group(self) -> str:
        return self.recipe.split('/')[1]

    @property
    def family(self) -> str:
        return self.recipe.split('/')[2]


RUNS = {
    'memo143-vit': Run('cifar10/memo143/vit', workers=2, quick_depth=1),
    'memo143-vit_hyperbf': Run('cifar10/memo143/vit_hyperbf', workers=3, quick_depth=1),
    'modern-vit': Run('cifar10/modern/vit', workers=3),
    'modern-vit_hyperbf': Run('cifar10/modern/vit_hyperbf', workers=3),
    'modern-vit_qimia': Run('cifar10/modern/vit_qimia', workers=3),
    # QIMIA's options, for when it trails the ViT (the issue asks for every run to be reported)
    'modern-vit_qimia-key_norm': Run('cifar10/modern/vit_qimia', workers=2, model_kwargs=dict(key_norm=True),
                                     tag='key_norm'),
    'modern-vit_qimia-block4': Run('cifar10/modern/vit_qimia', workers=2, model_kwargs=dict(memory_block_size=4),
                                   tag='block4'),
}
DEFAULT_RUNS = ('memo143-vit', 'memo143-vit_hyperbf', 'modern-vit', 'modern-vit_hyperbf', 'modern-vit_qimia')
EPOCHS = 100
BF16 = ('--amp', '--amp-dtype', 'bfloat16')  # as users train (the memo trained in float32)

# candidate models and batch size of each speed case
SPEED_CASES = {
    'hyperbf32': (('vit_hyperbf_tiny',), 1024),
    'qimia32': (('vit_qimia_tiny',), 1024),
    'hyperbf224': (('vit_hyperbf_tiny_patch16_224',), 256),
    'qimia224': (('vit_qimia_tiny_patch16_224',), 256),
}
QUICK_SPEED = ('--models', 'vit_hyperbf_tiny', 'vit_qimia_tiny', '--model-kwargs', 'depth=2', '--batch-size', '2',
               '--rounds', '1', '--steps', '1', '--warmup', '1')
ATTENTION_ARGS = ('--compiled', '--backends', 'flash', 'efficient', 'cudnn', '--flex')

# the papers' CIFAR-10 numbers and our targets, beside our tables
MEMO_TABLE_2 = {'vit': 75.61, 'vit_hyperbf': 75.12}  # CBMM Memo 143, Table 2, CIFAR-10 test top-1 (%)
MODERN_TARGETS = {'vit_hyperbf': (94.0, 0.99), 'vit_qimia': (None, 0.99)}  # test top-1 (%), ratio to the ViT
SPEED_TARGETS = dict(hyperbf=0.95, qimia_of_ceiling=0.9, attention=0.9)
DATASET_TAGS = {'cifar10': 'c10'}


# --- processes ------------------------------------------------------------------------------------------------------

class Context:
    """The arguments, the paths under ``--work``, the deadline and what the stages ran."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.quick = args.quick
        self.work = Path(args.work or ('/tmp/timm_hbf_gpu_quick' if args.quick else '/tmp/timm_hbf_gpu'))
        self.results = self.work / 'results'
        self.weights = self.work / 'weights'
        self.deadline = time.monotonic() + args.budget if args.budget else None
        self.command = ' '.join(['python', 'benchmarks/gpu.py', *args.argv])
        self.launched: Dict[str, subprocess.Popen] = {}
        self._env: Optional[Dict] = None

    def child_env(self, **extra: str) -> Dict[str, str]:
        """The environment of every subprocess: the carried wheels, then this checkout, on the path."""
        paths = [str(p) for p in (self.site(), ROOT) if p is not None] + [os.environ.get('PYTHONPATH', '')]
        return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p), PYTHONUNBUFFERED='1', **extra)

    def site(self) -> Optional[Path]:
        """``--work``/site with the wheels of ``.gpu/whl`` installed (once), or ``None`` without wheels."""
        wheels = sorted((GPU_DIR / 'whl').glob('*.whl')) if not self.quick else []
        if not wheels:
            return None
        site, done = self.work / 'site', self.work / 'site' / '.installed'
        if not done.exists():
            subprocess.run([sys.executable, '-m', 'pip', 'install', '-q', '--no-index', '--no-deps', '--no-compile',
                            '--upgrade', '--target', str(site), *map(str, wheels)], check=True)
            done.write_text('\n'.join(w.name for w in wheels) + '\n')
        return site

    def time_left(self) -> Optional[float]:
        """Seconds a subprocess may still take (``--budget`` less the packing reserve), ``None`` without a budget."""
        return None if self.deadline is None else self.deadline - PACK_RESERVE - time.monotonic()

    def environment(self) -> Dict:
        """Device and versions as the subprocesses see them (measured once per command)."""
        if self._env is None:
            out = subprocess.run([sys.executable, '-c', ENV_PROBE], capture_output=True, text=True, check=True,
                                 env=self.child_env(), cwd=ROOT).stdout
            self._env = json.loads(out.strip().splitlines()[-1])
        return self._env

    def record(self, stage: str, steps: List[Dict], **extra) -> Dict:
        """``results/<stage>/run.json``: environment, command, date, the commands run, and ``extra``."""
        record = dict(stage=stage, command=self.command, date=now(), environment=self.environment(), steps=steps,
                      **extra)
        write_json(self.results / stage / 'run.json', record)
        return record


ENV_PROBE = r'''
import importlib.metadata, json, os, platform, subprocess
import torch, timm, timm_hbf
cuda = torch.cuda.is_available()
env = dict(
    device=torch.cuda.get_device_name() if cuda else 'CPU (%s)' % (platform.processor() or platform.machine()),
    torch=torch.__version__, cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version() if cuda else None,
    timm=timm.__version__, timm_path=os.path.dirname(timm.__file__), timm_hbf=timm_hbf.__version__,
    python=platform.python_version(), cpus=os.cpu_count(), threads=torch.get_num_threads())
for name in ('torchvision', 'triton', 'transformers', 'huggingface_hub', 'safetensors', 'numpy', 'pillow'):
    try:
        env[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        env[name] = None
if cuda:
    smi = subprocess.run(['nvidia-smi', '--query-gpu=name,driver_version,memory.total', '--format=csv,noheader'],
                         capture_output=True, text=True)
    env['nvidia_smi'] = smi.stdout.strip()
    env['capability'] = '.'.join(map(str, torch.cuda.get_device_capability()))
print(json.dumps(env))
'''


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec='seconds')


def write_json(path: Path, content) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(content, indent=2) + '\n')


def run_logged(ctx: Context, command: Sequence[str], log: Path, **env: str) -> Dict:
    """``command`` with its output shown and written to ``log``; ended (with its children) when ``--budget`` runs
    out. Returns what ``run.json`` lists of it."""
    log.parent.mkdir(parents=True, exist_ok=True)
    command = [str(c) for c in command]
    print('---', ' '.join(command), flush=True)
    start = time.monotonic()
    with open(log, 'w') as f:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                env=ctx.child_env(**env), start_new_session=True)

        def copy_output() -> None:
            for line in proc.stdout:
                sys.stdout.write(line)
                f.write(line)

        reader = threading.Thread(target=copy_output)
        reader.start()
        try:
            left = ctx.time_left()
            proc.wait(timeout=None if left is None else max(left, 0))
            status = f'exit status {proc.returncode}' if proc.returncode else 'ok'
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = 'ended by --budget'
        reader.join()
        if status == 'ended by --budget':
            f.write(f'\n[gpu.py] ended after {time.monotonic() - start:.0f} s: --budget ran out\n')
    return dict(command=command, log=str(log.relative_to(ctx.results)), status=status,
                seconds=round(time.monotonic() - start, 1))


# --- stages ---------------------------------------------------------------------------------------------------------

def stage_env(ctx: Context) -> bool:
    env = ctx.environment()
    write_json(ctx.results / 'env.json', dict(env, command=ctx.command, date=now()))
    print(json.dumps(env, indent=2))
    return True


def stage_tests(ctx: Context) -> bool:
    """The CUDA tests (on the CPU with --quick: ``TIMM_HBF_TEST_DEVICE=cpu``)."""
    folder = ctx.results / 'tests'
    junit = folder / 'junit.xml'
    step = run_logged(ctx, [sys.executable, '-m', 'pytest', CUDA_TESTS, '-v', '-rfEs', '-p', 'no:cacheprovider',
                            f'--junitxml={junit}'], folder / 'cuda_tests.log',
                      **({'TIMM_HBF_TEST_DEVICE': 'cpu'} if ctx.quick else {}))
    counts = junit_counts(junit) if junit.exists() else {}
    ctx.record('tests', [step], counts=counts, rehearsal_on_cpu=ctx.quick)
    print('CUDA tests:', counts or 'no JUnit report')
    return step['status'] == 'ok'


def junit_counts(path: Path) -> Dict[str, int]:
    """Tests, failures, errors and skipped, from pytest's JUnit XML."""
    root = ElementTree.parse(path).getroot()
    suite = root if root.tag == 'testsuite' else root.find('testsuite')
    return {key: int(suite.get(key, 0)) for key in ('tests', 'failures', 'errors', 'skipped')}


def stage_speed(ctx: Context) -> bool:
    """One throughput.py run per case, then the targets table."""
    folder = ctx.results / 'speed'
    steps = []
    cases = ['quick'] if ctx.quick else ctx.args.speed_cases
    for case in cases:
        if ctx.quick:
            options = [*QUICK_SPEED, '--device', 'cpu', '--amp', '--mixer']
        else:
            models, batch = SPEED_CASES[case]
            options = ['--models', *models, '--batch-size', str(batch), '--device', 'cuda', '--amp', '--mixer',
                       '--compiled']
        steps.append(run_logged(ctx, [sys.executable, THROUGHPUT, *options, '--json', folder / f'{case}.json'],
                                folder / f'{case}.log'))
    ctx.record('speed', steps)
    write_targets(ctx)
    return all(s['status'] == 'ok' for s in steps)


def stage_attention(ctx: Context) -> bool:
    folder = ctx.results / 'attention'
    options = ['--quick'] if ctx.quick else ['--device', 'cuda', '--amp', *ATTENTION_ARGS]
    step = run_logged(ctx, [sys.executable, ATTENTION, *options, '--json', folder / 'attention.json'],
                      folder / 'attention.log')
    ctx.record('attention', [step])
    write_targets(ctx)
    return step['status'] == 'ok'


def write_targets(ctx: Context) -> None:
    """``results/speed_targets.md``: each speed target of the issue against what the JSONs hold so far."""
    lines = ['| target | case | mode | measured | met |', '|---|---|---|---|---|']
    for path in sorted((ctx.results / 'speed').glob('*.json')):
        if path.name == 'run.json':
            continue
        for row in json.loads(path.read_text())['results']:
            entry = row['models'][row['model']]
            for variant in ('eager', 'compiled'):
                if variant not in entry:
                    continue
                ratio = entry[variant]['throughput_ratio']
                case = f"`{row['model']}` {row['input']}, batch {row['batch_size']}, {variant}"
                if row['model'].startswith('vit_qimia'):
                    lines.append(target_line(f"QIMIA >= {SPEED_TARGETS['qimia_of_ceiling']}x its arithmetic "
                                             f"ceiling ({entry['ceiling']:.2f}x the ViT)", case, row['mode'],
                                             ratio / entry['ceiling'], SPEED_TARGETS['qimia_of_ceiling']))
                    roofline = entry[variant].get('roofline')  # the ceiling with the reads' bytes at bandwidth
                    if roofline is not None:
                        lines.append(target_line(f"QIMIA >= {SPEED_TARGETS['qimia_of_ceiling']}x its roofline "
                                                 f"({roofline:.2f}x the ViT)", case, row['mode'], ratio / roofline,
                                                 SPEED_TARGETS['qimia_of_ceiling']))
                else:
                    lines.append(target_line(f"HyperBF >= {SPEED_TARGETS['hyperbf']}x the ViT", case, row['mode'],
                                             ratio, SPEED_TARGETS['hyperbf']))
    attention = ctx.results / 'attention' / 'attention.json'
    if attention.exists():
        for row in json.loads(attention.read_text())['results']:
            for label, r in row['contenders'].items():
                if label.startswith('HyperBFAttention') and 'ratio' in r:
                    lines.append(target_line(f"attention layer >= {SPEED_TARGETS['attention']}x timm's Attention",
                                             f"{label}, {row['tokens']} tokens x {row['batch']}", row['mode'],
                                             r['ratio'], SPEED_TARGETS['attention']))
    (ctx.results / 'speed_targets.md').write_text('\n'.join(lines) + '\n')


def target_line(target: str, case: str, mode: str, value: float, needed: float) -> str:
    return f"| {target} | {case} | {mode} | {value:.3f} | {'yes' if value >= needed else '**no**'} |"


def data_dir(ctx: Context) -> Path:
    """The CIFAR-10 archive (``--dataset``; default ``.gpu/``'s, the mini one with ``--quick``) extracted once
    under ``--work``/data."""
    archive = Path(ctx.args.dataset) if ctx.args.dataset else \
        (DATASETS / MINI_ARCHIVE if ctx.quick else GPU_DIR / FULL_ARCHIVE)
    if not archive.is_file():
        raise SystemExit(f'{archive}: no such archive (benchmarks/gpu.py prepare copies it into .gpu/).')
    dest = ctx.work / 'data' / archive.name.split('.')[0]
    if not (dest / 'train').is_dir():
        dest.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(dir=dest.parent, prefix='.partial-'))
        with tarfile.open(archive) as tar:
            tar.extractall(partial, **({'filter': 'data'} if hasattr(tarfile, 'data_filter') else {}))
        partial.rename(dest)
    return dest


def train_args(ctx: Context, run: Run) -> List[str]:
    """train.py's options after the recipe's: epochs, workers, bf16, and the model kwargs when the run (or the
    rehearsal's depth) adds to the recipe's (train.py replaces the recipe's model_kwargs with the command line's)."""
    kwargs = dict(yaml.safe_load((RECIPES / f'{run.recipe}.yaml').read_text()).get('model_kwargs') or {})
    kwargs.update(run.model_kwargs)
    if ctx.quick:
        kwargs['depth'] = run.quick_depth
        options = ['--device', 'cpu', '--epochs', '1', '--batch-size', '32', '--workers', '1', *BF16]
    else:
        options = ['--epochs', str(EPOCHS), '--workers', str(run.workers), *BF16, '--pin-mem']
    if kwargs and (run.model_kwargs or ctx.quick):
        options += ['--model-kwargs', *(f'{k}={v}' for k, v in kwargs.items())]
    return options


def stage_accuracy(ctx: Context) -> bool:
    """Start every run of ``--runs`` that has not been started, each in the background; with ``--wait``, wait."""
    data = data_dir(ctx)
    scripts = Path(ctx.args.scripts) if ctx.args.scripts else GPU_DIR
    steps = []
    for name in ctx.args.runs:
        run, out = RUNS[name], ctx.results / 'accuracy' / name
        if (out / 'launch.json').exists():
            print(f'{name}: started before, see the status stage')
            continue
        command = [sys.executable, str(ACCURACY), '--scripts', str(scripts), '--data', str(data), '--runs',
                   run.recipe, '--out', str(out), *(['--val-per-class', '10'] if ctx.quick else []),
                   '--', *train_args(ctx, run)]
        out.mkdir(parents=True)
        with open(out / 'log.txt', 'w') as log:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=ctx.child_env(),
                                    start_new_session=True)  # setsid: it outlives this command
        ctx.launched[name] = proc
        launch = dict(name=name, recipe=run.recipe, command=command, pid=proc.pid, started=time.time(), date=now(),
                      workers=run.workers)
        write_json(out / 'launch.json', launch)
        steps.append(launch)
        print(f"{name}: started (pid {proc.pid}): {' '.join(command)}", flush=True)
    ctx.record('accuracy', steps)
    if ctx.args.wait:
        return stage_status(ctx)
    return True


def pid_running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, finished but not yet reaped, does not)."""
    try:
        with open(f'/proc/{pid}/stat') as f:
            return f.read().rsplit(')', 1)[1].split()[0] != 'Z'
    except OSError:
        return False


def run_state(ctx: Context, out: Path) -> Dict:
    """One accuracy run as it stands: finished, running or failed; epochs so far and time left."""
    launch = json.loads((out / 'launch.json').read_text())
    proc = ctx.launched.get(launch['name'])
    running = proc.poll() is None if proc is not None else pid_running(launch['pid'])
    experiment = launch['recipe'].replace('/', '-')
    run_dir = out / 'runs' / experiment
    epochs = read_summary(run_dir / 'summary.csv')
    trained = yaml.safe_load((run_dir / 'args.yaml').read_text()) if (run_dir / 'args.yaml').exists() else {}
    total = trained.get('epochs')
    state = 'finished' if (out / 'accuracy.json').exists() else 'running' if running else 'failed'
    ended = time.time() if state == 'running' else (out / 'log.txt').stat().st_mtime
    # seconds per epoch so far, start-up included: up to the last epoch written
    per_epoch = ((run_dir / 'summary.csv').stat().st_mtime - launch['started']) / len(epochs) if epochs else None
    return dict(
        name=launch['name'], recipe=launch['recipe'], state=state, run_dir=run_dir, model=trained.get('model'),
        epochs_done=len(epochs), epochs=total, elapsed_s=round(ended - launch['started']),
        s_per_epoch=per_epoch and round(per_epoch, 1),
        eta_s=round(per_epoch * (total - len(epochs))) if per_epoch and total and state == 'running' else None,
        val_top1=max((e['eval_top1'] for e in epochs), default=None), summary=epochs,
    )


def read_summary(path: Path) -> List[Dict[str, float]]:
    if not path.exists():
        return []
    with open(path, newline='') as f:
        return [{k: float(v) for k, v in row.items() if v != ''} for row in csv.DictReader(f)]


def all_states(ctx: Context) -> List[Dict]:
    return [run_state(ctx, p.parent) for p in sorted((ctx.results / 'accuracy').glob('*/launch.json'))]


def stage_status(ctx: Context) -> bool:
    """Print every run's state (waiting up to ``--wait`` seconds for the running ones), then merge them."""
    waited_until = time.monotonic() + (ctx.args.wait or 0)
    if ctx.time_left() is not None:
        waited_until = min(waited_until, time.monotonic() + ctx.time_left() - 60)  # a minute for weights and pack
    while True:
        states = all_states(ctx)
        print(status_table(states), flush=True)
        if not any(s['state'] == 'running' for s in states) or time.monotonic() >= waited_until:
            break
        time.sleep(max(1., min(5. if ctx.quick else 60., waited_until - time.monotonic())))
    (ctx.results / 'accuracy').mkdir(parents=True, exist_ok=True)
    (ctx.results / 'accuracy' / 'status.md').write_text(f'{now()}\n\n{status_table(states)}')
    for s in states:
        if s['state'] == 'failed':
            log = (ctx.results / 'accuracy' / s['name'] / 'log.txt').read_text().splitlines()
            print(f"--- {s['name']} failed; the end of its log:\n" + '\n'.join(log[-25:]))
    collect(ctx, states)
    return not any(s['state'] == 'failed' for s in states)


def status_table(states: List[Dict]) -> str:
    lines = ['| run | state | epochs | best validation top-1 (%) | s/epoch | elapsed s | left s (estimate) |',
             '|---|---|---|---|---|---|---|']
    for s in states:
        val = '' if s['val_top1'] is None else f"{s['val_top1']:.2f}"
        lines.append(f"| {s['name']} | {s['state']} | {s['epochs_done']}/{s['epochs'] or '?'} | {val} | "
                     f"{s['s_per_epoch'] or ''} | {s['elapsed_s']} | {s['eta_s'] if s['eta_s'] is not None else ''} |")
    return '\n'.join(lines) + '\n'


def collect(ctx: Context, states: List[Dict]) -> None:
    """``results/accuracy/accuracy_<recipe>.{json,md,png}``: every run of the recipe, finished or not, with the
    papers' numbers and our targets."""
    for group in sorted({RUNS[s['name']].group for s in states}):
        runs = []
        for s in (s for s in states if RUNS[s['name']].group == group):
            result = ctx.results / 'accuracy' / s['name'] / 'accuracy.json'
            record = json.loads(result.read_text()) if result.exists() else {}
            finished = record.get('runs', [{}])[0]
            runs.append(dict(
                name=s['name'], recipe=s['recipe'], family=RUNS[s['name']].family, tag=RUNS[s['name']].tag,
                model_kwargs=RUNS[s['name']].model_kwargs, state=s['state'],
                model=s['model'], epochs_done=s['epochs_done'], epochs_planned=s['epochs'],
                val_top1=finished.get('val_top1', s['val_top1']), best_epoch=finished.get('best_epoch'),
                test_top1=finished.get('test_top1'), train_command=finished.get('train_command'),
                test_command=finished.get('test_command'), device=record.get('device'),
                versions=record.get('versions'), date=record.get('date'), accuracy_command=record.get('command'),
                val_per_class=record.get('val_per_class'), epochs=s['summary'],
            ))
        vit = next((r['test_top1'] for r in runs if r['name'] == f'{group}-vit' and r['test_top1']), None)
        for r in runs:
            r['test_ratio_to_vit'] = r['test_top1'] / vit if vit and r['test_top1'] is not None else None
        stem = ctx.results / 'accuracy' / f'accuracy_{group}'
        write_json(stem.with_suffix('.json'), dict(recipe=group, command=ctx.command, date=now(),
                                                   environment=ctx.environment(), runs=runs))
        stem.with_suffix('.md').write_text(accuracy_table(group, runs))
        plot_accuracy(group, runs, stem.with_suffix('.png'))


def accuracy_table(group: str, runs: List[Dict]) -> str:
    paper = group == 'memo143'
    lines = ['| run | model | state | epochs | best validation top-1 (%) | at epoch | test top-1 (%) | ratio to ViT | '
             + ('memo, Table 2 (%) |' if paper else 'target |'), '|---|---|---|---|---|---|---|---|---|']
    for r in runs:
        test = '' if r['test_top1'] is None else f"{r['test_top1']:.2f}"
        ratio = '' if r['test_ratio_to_vit'] is None else f"{r['test_ratio_to_vit']:.3f}"
        val = '' if r['val_top1'] is None else f"{r['val_top1']:.2f}"
        if r['tag']:  # an option tried: no paper's number or target of its own
            last = ''
        elif paper:
            last = f"{MEMO_TABLE_2[r['family']]:.2f}" if r['family'] in MEMO_TABLE_2 else ''
        else:
            top1, ratio_needed = MODERN_TARGETS.get(r['family'], (None, None))
            last = ', '.join(t for t in (top1 and f'>= {top1} %', ratio_needed and f'>= {ratio_needed}x ViT') if t)
        lines.append(f"| {r['name']} | `{r['model']}` | {r['state']} | {r['epochs_done']}/{r['epochs_planned']} | "
                     f"{val} | {'' if r['best_epoch'] is None else r['best_epoch']} | {test} | {ratio} | {last} |")
    held_out = next((r['val_per_class'] for r in runs if r['val_per_class']), None)
    note = ('Test top-1 on the JPEG copy of CIFAR-10 (../shared/datasets), which costs a little against the '
            f'original images the papers used; validation: {held_out} train images per class held out, never trained '
            'on; the test split measured once, with the checkpoint chosen on validation.')
    return '\n'.join(lines) + f'\n\n{note}\n'


def plot_accuracy(group: str, runs: List[Dict], path: Path) -> None:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    for r in runs:
        ax.plot([e['epoch'] + 1 for e in r['epochs']], [e['eval_top1'] for e in r['epochs']], label=r['name'],
                linestyle='-' if r['state'] == 'finished' else '--')
    ax.set_title(f'CIFAR-10, {group} recipe', fontsize=9)
    ax.set_xlabel('epoch')
    ax.set_ylabel('validation top-1 (%)')
    ax.legend(fontsize=7)
    ax.grid(alpha=.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def hub_name(trained: Dict, run: Run) -> str:
    """The repo name of a run's weights: the model name (timm's ViT named by the patch and size it was trained at:
    ``vit_tiny_patch16_224`` at patch 4 and 32 x 32 is ``vit_tiny_patch4_32``), the dataset's tag and the run's."""
    name, kwargs = trained['model'], trained.get('model_kwargs') or {}
    if 'patch_size' in kwargs and 'img_size' in kwargs:
        name = re.sub(r'_patch\d+_\d+$', f"_patch{kwargs['patch_size']}_{kwargs['img_size']}", name)
    return f"{name}.{DATASET_TAGS[run.recipe.split('/')[0]]}" + (f'_{run.tag}' if run.tag else '')


def stage_weights(ctx: Context) -> bool:
    """A Hub-ready folder (bf16 weights) of every finished modern-recipe run (also unfinished ones with
    ``--include-unfinished``: their best checkpoint so far)."""
    labels = sorted(p.name for p in (data_dir(ctx) / 'train').iterdir() if p.is_dir())
    steps, made, ok = [], [], True
    for s in all_states(ctx):
        wanted = s['state'] == 'finished' or (ctx.args.include_unfinished and s['epochs_done'])
        if RUNS[s['name']].group != 'modern' or not wanted:
            continue
        trained = yaml.safe_load((s['run_dir'] / 'args.yaml').read_text())
        name = hub_name(trained, RUNS[s['name']])
        folder = ctx.weights / name
        if folder.exists():
            shutil.rmtree(folder)
        step = run_logged(ctx, [sys.executable, '-m', 'timm_hbf.cli', 'push', s['run_dir'], '--repo-id',
                                f'{ctx.args.hub_org}/{name}', '--dtype', 'bfloat16', '--label-names', *labels,
                                *(['--ema'] if trained.get('model_ema') else []), '--dry-run', folder],
                          ctx.results / 'weights' / f'{name}.log')
        steps.append(step)
        if step['status'] != 'ok':
            ok = False
            continue
        weights = folder / 'model.safetensors'
        result = ctx.results / 'accuracy' / s['name'] / 'accuracy.json'
        finished = json.loads(result.read_text())['runs'][0] if result.exists() else {}
        made.append(dict(name=name, repo_id=f'{ctx.args.hub_org}/{name}', run=s['name'], state=s['state'],
                         epochs=s['epochs_done'], test_top1=finished.get('test_top1'), val_top1=s['val_top1'],
                         bytes=weights.stat().st_size, sha256=hashlib.sha256(weights.read_bytes()).hexdigest()))
        if weights.stat().st_size >= FILE_LIMIT:
            print(f'{weights}: {weights.stat().st_size} bytes, over the 16 MiB a file may have to come back')
            ok = False
    ctx.record('weights', steps, weights=made)
    lines = ['| weights | run | epochs | test top-1 (%) | model.safetensors (MB) |', '|---|---|---|---|---|']
    lines += [f"| {w['repo_id']} | {w['run']} | {w['epochs']} | "
              f"{'' if w['test_top1'] is None else format(w['test_top1'], '.2f')} | {w['bytes'] / 1e6:.1f} |"
              for w in made]
    (ctx.results / 'weights' / 'weights.md').write_text('\n'.join(lines) + '\n')
    print('\n'.join(lines))
    return ok


def stage_pack(ctx: Context) -> bool:
    """``results.tar.gz`` (everything under results/ but checkpoints and the data split's links) and one
    ``weights-<name>.tar`` per Hub-ready folder, checked against the device tool's limits."""
    dest = Path(ctx.args.pack_dir or os.environ.get('OUT') or ctx.work / 'out')
    dest.mkdir(parents=True, exist_ok=True)
    ctx.results.mkdir(parents=True, exist_ok=True)

    def keep(info: tarfile.TarInfo) -> Optional[tarfile.TarInfo]:
        return None if info.issym() or info.islnk() or info.name.endswith('.pth.tar') else info

    files = [dest / 'results.tar.gz']
    with tarfile.open(files[0], 'w:gz') as tar:
        tar.add(ctx.results, arcname='.', filter=keep)
    for folder in sorted(p for p in ctx.weights.glob('*') if p.is_dir()) if ctx.weights.exists() else []:
        files.append(dest / f'weights-{folder.name}.tar')
        with tarfile.open(files[-1], 'w') as tar:
            tar.add(folder, arcname=folder.name)
    too_big = [f'{f.name} ({f.stat().st_size / 2 ** 20:.1f} MiB)' for f in files if f.stat().st_size > FILE_LIMIT]
    print('packed:', ', '.join(f'{f.name} {f.stat().st_size / 2 ** 20:.2f} MiB' for f in files))
    if too_big or len(files) > FILE_COUNT_LIMIT:
        print(f'over the device tool\'s limits ({FILE_COUNT_LIMIT} files of 16 MiB): {len(files)} files; '
              f"too big: {', '.join(too_big) or 'none'}")
        return False
    return True


def stage_prepare(ctx: Context) -> bool:
    """Fill ``.gpu/`` here: timm's train.py and validate.py, the CIFAR-10 archive and a timm wheel; check that what
    a device call sends stays under 64 MiB."""
    if subprocess.run(['git', 'check-ignore', '-q', '.gpu/'], cwd=ROOT).returncode != 0:
        raise SystemExit('.gpu/ is not ignored by git: add /.gpu/ to .gitignore (or .git/info/exclude).')
    if not ctx.args.timm_repo:
        raise SystemExit('prepare needs --timm-repo: a clone of https://github.com/huggingface/pytorch-image-models '
                         '(a checkout or a bare git folder), for train.py and validate.py.')
    GPU_DIR.mkdir(exist_ok=True)
    repo = Path(ctx.args.timm_repo)
    for script in ('train.py', 'validate.py'):
        if (repo / script).is_file():
            shutil.copyfile(repo / script, GPU_DIR / script)
        else:
            content = subprocess.run(['git', f'--git-dir={repo}', 'show', f'{ctx.args.timm_rev}:{script}'],
                                     capture_output=True, check=True).stdout
            (GPU_DIR / script).write_bytes(content)
    archive = Path(ctx.args.dataset) if ctx.args.dataset else DATASETS / FULL_ARCHIVE
    shutil.copyfile(archive, GPU_DIR / FULL_ARCHIVE)
    if ctx.args.timm_wheel:
        subprocess.run([sys.executable, '-m', 'pip', 'download', '-q', '--no-deps', '--only-binary=:all:',
                        '--python-version', '3.12', '--implementation', 'cp', '-d', str(GPU_DIR / 'whl'),
                        f'timm=={ctx.args.timm_wheel}'], check=True)
    listed = subprocess.run(['git', 'ls-files', '-z', '--cached', '--others', '--exclude-standard'], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split('\0')
    tree = sum((ROOT / p).stat().st_size for p in listed if p and (ROOT / p).is_file())
    carried = sum(p.stat().st_size for p in GPU_DIR.rglob('*') if p.is_file())
    print(f'.gpu/: {", ".join(sorted(p.name for p in GPU_DIR.iterdir()))}\n'
          f'a device call sends {(tree + carried) / 2 ** 20:.1f} MiB (working tree {tree / 2 ** 20:.1f}, .gpu/ '
          f'{carried / 2 ** 20:.1f}) of the 64 MiB it may')
    return tree + carried <= TREE_LIMIT


def stage_unpack(ctx: Context) -> bool:
    """The packed files of a device call (``--from``) into ``--results-dest`` and ``--weights-dest``."""
    source = Path(ctx.args.source)
    extract = {'filter': 'data'} if hasattr(tarfile, 'data_filter') else {}
    with tarfile.open(source / 'results.tar.gz') as tar:
        tar.extractall(ctx.args.results_dest, **extract)
    for packed in sorted(source.glob('weights-*.tar')):
        with tarfile.open(packed) as tar:
            tar.extractall(ctx.args.weights_dest, **extract)
    print(f'unpacked {source} into {ctx.args.results_dest} and {ctx.args.weights_dest}')
    return True


STAGE_FUNCTIONS = dict(env=stage_env, tests=stage_tests, speed=stage_speed, attention=stage_attention,
                       accuracy=stage_accuracy, status=stage_status, weights=stage_weights, pack=stage_pack,
                       prepare=stage_prepare, unpack=stage_unpack)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('stages', nargs='+', choices=[*STAGES, 'all'], metavar='STAGE',
                        help=f"{', '.join(STAGES)}, or all ({' '.join(ALL)})")
    parser.add_argument('--quick', action='store_true', help='everything on the CPU at tiny sizes (a rehearsal)')
    parser.add_argument('--work', help='state folder (default: /tmp/timm_hbf_gpu, /tmp/timm_hbf_gpu_quick)')
    parser.add_argument('--budget', type=float, help='seconds this command may take: subprocesses still running '
                                                     f'{PACK_RESERVE} s before are ended, so that pack runs')
    parser.add_argument('--speed-cases', nargs='+', choices=list(SPEED_CASES), default=list(SPEED_CASES))
    parser.add_argument('--runs', nargs='+', choices=list(RUNS), default=list(DEFAULT_RUNS),
                        help='accuracy runs (default: %(default)s)')
    parser.add_argument('--scripts', help="folder with timm's train.py and validate.py (default: .gpu/)")
    parser.add_argument('--dataset', help='CIFAR-10 archive (default: .gpu/ or ../shared/datasets; mini with --quick)')
    parser.add_argument('--wait', type=float, help='accuracy, status: wait up to this many seconds for the runs '
                                                   '(default: 0; with --quick, until they finish)')
    parser.add_argument('--include-unfinished', action='store_true',
                        help='weights: also of runs that have not finished (their best checkpoint so far)')
    parser.add_argument('--hub-org', default='ORG', help='the organisation named in the weights\' repo ids')
    parser.add_argument('--pack-dir', help='pack: where the files go (default: $OUT, else --work/out)')
    parser.add_argument('--timm-repo', help="prepare: a clone of timm's git repository (checkout or bare)")
    parser.add_argument('--timm-rev', default='HEAD', help='prepare: the revision of train.py and validate.py')
    parser.add_argument('--timm-wheel', default=installed_timm(), help='prepare: the timm version to carry as a '
                                                                       "wheel (default: this environment's, "
                                                                       "%(default)s); '' for none")
    parser.add_argument('--from', dest='source', help='unpack: the folder the device call\'s files came back in')
    parser.add_argument('--results-dest', default=str(ROOT / 'benchmarks' / 'results' / 'gpu'))
    parser.add_argument('--weights-dest', default=str(ROOT / 'weights'))
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.stages = [s for stage in args.stages for s in (ALL if stage == 'all' else (stage,))]
    if args.wait is None:
        args.wait = 1e9 if args.quick else 0
    if 'unpack' in args.stages and not args.source:
        parser.error('unpack needs --from FOLDER')
    return args


def installed_timm() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version('timm')
    except PackageNotFoundError:
        return ''


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the stages in order, each whatever the last one gave; returns 1 if any failed."""
    ctx = Context(parse_args(argv))
    failed = []
    for stage in ctx.args.stages:
        print(f'=== {stage} ({now()})', flush=True)
        if not STAGE_FUNCTIONS[stage](ctx):
            failed.append(stage)
    print(f"=== done ({now()}){': failed ' + ', '.join(failed) if failed else ''}", flush=True)
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
