"""Record finished train.py runs of one recipe side by side: what they were, where and how long they ran, and how they
did on the test split after every epoch (train.py's ``summary.csv``, ``eval_top1``).

    python benchmarks/record_runs.py RUN_DIR [RUN_DIR ...] --baseline vit_tiny_patch16_224 --out benchmarks/results/X

Each RUN_DIR is a train.py output folder (``args.yaml``, ``summary.csv``) with its console log beside it as
``RUN_DIR.log``; lines ``=== start DATE``, ``=== command: ...`` and ``=== end DATE`` in the log (written by whatever
launched and resumed the run) give its dates and command. The time of an epoch is train.py's own per-batch average
times its batches, for training and for the test pass. The reported accuracy is that of the last epoch: no epoch is
chosen on the test split. Writes ``runs.json``, ``runs.md`` (the table) and ``runs.png`` (test top-1 per epoch).
"""
import argparse
import json
import platform
import re
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import timm
import torch
import yaml

from timm_hbf.hub import read_summary

# train.py's log lines of a training batch (index/batches, mean s per batch) and of a test batch (index/last index),
# of the weights or, with --model-ema, of the EMA weights after them
TRAIN_LINE = re.compile(r'^Train: (\d+) \[\s*(\d+)/(\d+) .*?Time: [\d.]+s, +[\d.]+/s +\(\s*([\d.]+)s,')
TEST_LINE = re.compile(r'^Test(?: \(EMA\))?: \[\s*(\d+)/(\d+)\]  Time: [\d.]+ \(\s*([\d.]+)\)')
ARGS_KEPT = ('model', 'model_kwargs', 'epochs', 'batch_size', 'opt', 'lr', 'lr_base', 'lr_base_size', 'weight_decay',
             'sched', 'warmup_epochs', 'min_lr', 'smoothing', 'scale', 'hflip', 'color_jitter', 'aa', 'mixup', 'cutmix',
             'reprob', 'drop_path', 'model_ema', 'seed', 'amp', 'amp_dtype', 'torchcompile', 'device')


def cpu_model() -> str:
    for line in Path('/proc/cpuinfo').read_text().splitlines() if Path('/proc/cpuinfo').exists() else []:
        if line.startswith('model name'):
            return line.split(':', 1)[1].strip()
    return platform.processor() or platform.machine()


def epoch_seconds(log: str) -> Dict[int, float]:
    """Seconds per epoch from train.py's log: the running mean batch time of an epoch's last logged batch, times its
    batches, for training and for the test passes that follow it (with an EMA, two: the weights', the EMA's; a resumed
    epoch counts its last attempt)."""
    seconds: Dict[int, float] = {}
    epoch = -1
    for line in log.splitlines():
        train, test = TRAIN_LINE.match(line), TEST_LINE.match(line)
        if train and int(train[2]) + 1 == int(train[3]):
            epoch = int(train[1])
            seconds[epoch] = float(train[4]) * int(train[3])
        elif test and test[1] == test[2] and epoch in seconds:
            seconds[epoch] += float(test[3]) * (int(test[2]) + 1)
    return seconds


def record(run_dir: Path) -> Dict:
    log_path = run_dir.parent / f'{run_dir.name}.log'  # not with_suffix: a variant's name may hold a '.'
    if not (run_dir / 'summary.csv').is_file() or not log_path.is_file():
        raise SystemExit(f'{run_dir}: expected a train.py output folder with summary.csv, and its log at {log_path}.')
    args = yaml.safe_load((run_dir / 'args.yaml').read_text())
    log = log_path.read_text()
    seconds = epoch_seconds(log)
    epochs = read_summary(run_dir / 'summary.csv')  # one row per epoch, also of a resumed run
    for row in epochs:
        row['seconds'] = seconds.get(int(row['epoch']))
    return dict(
        model=args['model'], run=run_dir.name, args={k: args.get(k) for k in ARGS_KEPT},
        commands=sorted(set(re.findall(r'^=== command: (.*)$', log, re.M))),
        started=re.findall(r'^=== start (\S+)', log, re.M), ended=re.findall(r'^=== end (\S+)', log, re.M),
        epochs=epochs, test_top1=epochs[-1]['eval_top1'] if epochs else None,
        cpu_hours=sum(s for s in seconds.values()) / 3600.)


def markdown(runs: List[Dict], baseline: Optional[str]) -> str:
    base = next((r['test_top1'] for r in runs if r['model'] == baseline), None)
    lines = ['| model | epochs | test top-1 (%) | ratio to the baseline | hours |', '|---|---|---|---|---|']
    for r in runs:
        ratio = f"{r['test_top1'] / base:.3f}" if base else ''
        lines.append(f"| `{r['model']}` | {len(r['epochs'])} | {r['test_top1']:.2f} | {ratio} | {r['cpu_hours']:.2f} |")
    return '\n'.join(lines) + '\n'


def plot(runs: List[Dict], path: Path) -> None:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4), layout='constrained')
    for r in runs:
        ax.plot([e['epoch'] + 1 for e in r['epochs']], [e['eval_top1'] for e in r['epochs']], marker='o', ms=3,
                label=r['model'])
    ax.set_xlabel('epoch')
    ax.set_ylabel('test top-1 (%)')
    ax.grid(alpha=.3)
    ax.legend()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('runs', nargs='+', type=Path, help='train.py output folders')
    parser.add_argument('--baseline', help='the model the others are compared with')
    parser.add_argument('--data-note', default='', help='what the data were, for the record')
    parser.add_argument('--out', type=Path, required=True)
    args = parser.parse_args(argv)
    runs = [record(run) for run in args.runs]
    result = dict(
        machine=dict(cpu=cpu_model(), platform=platform.platform(), threads=torch.get_num_threads()),
        versions=dict(python=platform.python_version(), torch=torch.__version__, timm=timm.__version__),
        data=args.data_note, baseline=args.baseline, runs=runs)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / 'runs.json').write_text(json.dumps(result, indent=2) + '\n')
    (args.out / 'runs.md').write_text(markdown(runs, args.baseline))
    plot(runs, args.out / 'runs.png')
    print(markdown(runs, args.baseline))
    return result


if __name__ == '__main__':
    main()
