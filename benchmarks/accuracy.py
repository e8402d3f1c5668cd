"""Accuracy runs through timm's train.py and our recipes, with choices made on a validation split, never the test set.

Each run is ``timm_hbf/recipes/<dataset>/<recipe>/<family>.yaml``. The data folder (ImageFolder layout, ``train/``
and ``test/``) is first split into ``train/``, ``val/`` and ``test/`` of symbolic links: ``--val-per-class``
images of every class of ``train/``, evenly spaced, are held out as ``val/`` and never trained on. train.py trains
on ``train/``, evaluates every epoch on ``val/`` and keeps its best checkpoint by that accuracy; validate.py then
measures that checkpoint (its EMA weights when the recipe uses EMA) once on ``test/``. Writes ``accuracy.json``
(every epoch of every run, validation and test top-1, device, versions and commands), ``accuracy.md`` (the table)
and ``accuracy.png`` (validation top-1 per epoch) into ``--out``.

    python benchmarks/accuracy.py --scripts pytorch-image-models --data cifar10 \\
        --runs cifar10/modern/vit cifar10/modern/vit_hyperbf cifar10/modern/vit_qimia -- --amp --amp-dtype bfloat16
    python benchmarks/accuracy.py --scripts pytorch-image-models --data cifar10 --nproc 4 \\
        --runs cifar10/memo143/vit cifar10/memo143/vit_hyperbf

``--scripts`` is a checkout of timm's git repository (train.py and validate.py are not installed with timm).
Arguments after ``--`` go to train.py (``--epochs 10`` overrides the recipe's epochs; ``--device cpu`` without a GPU).
"""
import argparse
import csv
import json
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import timm
import torch
import yaml

import timm_hbf

ROOT = Path(__file__).resolve().parents[1]
RECIPES = Path(timm_hbf.__file__).resolve().parent / 'recipes'
IMAGE_SUFFIXES = ('.png', '.jpg', '.jpeg', '.bmp', '.webp')


def split_data(source: Path, dest: Path, val_per_class: int) -> Path:
    """``dest/{train,val,test}`` as symbolic links into ``source``: ``val_per_class`` images of every class of
    ``source/train``, evenly spaced in name order, go to ``val``; ``test`` is ``source/test`` as it is."""
    if not (source / 'train').is_dir() or not (source / 'test').is_dir():
        raise SystemExit(f"--data {source}: expected an ImageFolder layout with train/ and test/ folders (the CIFAR-10 "
                         f"archive of the README extracts to one).")
    for class_dir in sorted(p for p in (source / 'train').iterdir() if p.is_dir()):
        images = sorted(p for p in class_dir.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if val_per_class >= len(images):
            raise SystemExit(f'--val-per-class {val_per_class} leaves no training image of class {class_dir.name} '
                             f'({len(images)} images).')
        held_out = {i * len(images) // val_per_class for i in range(val_per_class)}
        for i, image in enumerate(images):
            link = dest / ('val' if i in held_out else 'train') / class_dir.name / image.name
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.is_symlink():
                link.symlink_to(image.resolve())
    if not (dest / 'test').is_symlink():
        (dest / 'test').symlink_to((source / 'test').resolve(), target_is_directory=True)
    return dest


def recipe_path(run: str) -> Path:
    path = RECIPES / f'{run}.yaml'
    if not path.is_file():
        known = sorted(str(p.relative_to(RECIPES).with_suffix('')) for p in RECIPES.glob('*/*/*.yaml'))
        raise SystemExit(f"--runs {run}: no recipe {path}. Recipes: {' '.join(known)}")
    return path


def train_command(args, run: str, data: Path, experiment: str) -> List[str]:
    launcher = [sys.executable] if args.nproc == 1 else \
        [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', str(args.nproc)]
    return [*launcher, '-m', 'timm_hbf.run', str(Path(args.scripts) / 'train.py'), '-c', str(recipe_path(run)),
            '--data-dir', str(data), '--train-split', 'train', '--val-split', 'val',
            '--output', str(Path(args.out) / 'runs'), '--experiment', experiment, *args.train_args]


def test_command(args, run_dir: Path, data: Path, trained: Dict) -> List[str]:
    """validate.py on the test split, with the model, preprocessing and device of the run (``trained``: train.py's
    ``args.yaml``, so that options given after ``--`` count) and its best checkpoint."""
    options = ['--model', trained['model'], '--num-classes', str(trained['num_classes']),
               '--img-size', str(trained['img_size']), '--crop-pct', str(trained['crop_pct']),
               '--mean', *map(str, trained['mean']), '--std', *map(str, trained['std']), '--device', trained['device']]
    if trained.get('model_kwargs'):
        options += ['--model-kwargs', *(f'{k}={v}' for k, v in trained['model_kwargs'].items())]
    if trained.get('model_ema'):
        options.append('--use-ema')
    return [sys.executable, '-m', 'timm_hbf.run', str(Path(args.scripts) / 'validate.py'), '--data-dir', str(data),
            '--split', 'test', '--checkpoint', str(run_dir / 'model_best.pth.tar'), *options,
            '--results-file', str(run_dir / 'test.json'), '--results-format', 'json']


def read_summary(path: Path) -> List[Dict[str, float]]:
    """train.py's ``summary.csv``: one dict of floats per epoch."""
    with open(path, newline='') as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def markdown(runs: List[Dict]) -> str:
    lines = ['| run | model | epochs | best validation top-1 (%) | at epoch | test top-1 (%) |',
             '|---|---|---|---|---|---|']
    for r in runs:
        lines.append(f"| {r['run']} | `{r['model']}` | {len(r['epochs'])} | {r['val_top1']:.2f} | "
                     f"{r['best_epoch']} | {r['test_top1']:.2f} |")
    return '\n'.join(lines) + '\n'


def plot(runs: List[Dict], path: Path) -> None:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    for r in runs:
        ax.plot([e['epoch'] + 1 for e in r['epochs']], [e['eval_top1'] for e in r['epochs']], label=r['run'])
    ax.set_xlabel('epoch')
    ax.set_ylabel('validation top-1 (%)')
    ax.legend(fontsize=7)
    ax.grid(alpha=.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    given = list(sys.argv[1:] if argv is None else argv)
    train_args = given[given.index('--') + 1:] if '--' in given else []
    argv = given[:given.index('--')] if '--' in given else given
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--scripts', required=True, help="folder with timm's train.py and validate.py")
    parser.add_argument('--data', required=True, help='ImageFolder dataset with train/ and test/')
    parser.add_argument('--runs', nargs='+', required=True, help='recipes as DATASET/RECIPE/FAMILY')
    parser.add_argument('--val-per-class', type=int, default=500, help='train images per class held out (default: '
                                                                       '%(default)s, 5000 for CIFAR-10)')
    parser.add_argument('--nproc', type=int, default=1, help='processes (GPUs) per run, through torchrun')
    parser.add_argument('--out', default=str(ROOT / 'benchmarks' / 'results' / 'accuracy'))
    args = parser.parse_args(argv)
    args.train_args = train_args
    for script in ('train.py', 'validate.py'):
        if not (Path(args.scripts) / script).is_file():
            raise SystemExit(f"--scripts {args.scripts}: no {script}. It is in timm's git repository: "
                             'git clone https://github.com/huggingface/pytorch-image-models')
    for run in args.runs:  # every recipe exists before anything runs
        recipe_path(run)
    out = Path(args.out)
    data = split_data(Path(args.data), out / 'data', args.val_per_class)
    record = dict(
        date=datetime.now(timezone.utc).isoformat(timespec='seconds'),
        command=' '.join(['accuracy.py', *given]),
        device=torch.cuda.get_device_name() if torch.cuda.is_available() and '--device' not in train_args
        else f'CPU ({platform.processor() or platform.machine()})',
        versions=dict(torch=torch.__version__, cuda=torch.version.cuda, timm=timm.__version__,
                      timm_hbf=timm_hbf.__version__, python=platform.python_version()),
        val_per_class=args.val_per_class, runs=[],
    )
    env = dict(os.environ, PYTHONUNBUFFERED='1')
    for run in args.runs:
        experiment = run.replace('/', '-')
        run_dir = out / 'runs' / experiment
        if run_dir.exists():
            raise SystemExit(f'{run_dir} exists (train.py would append to its summary.csv): remove it or choose '
                             'another --out.')
        train = train_command(args, run, data, experiment)
        print('---', ' '.join(train), flush=True)
        subprocess.run(train, check=True, env=env)
        trained = yaml.safe_load((run_dir / 'args.yaml').read_text())
        test = test_command(args, run_dir, data, trained)
        print('---', ' '.join(test), flush=True)
        subprocess.run(test, check=True, env=env)
        epochs = read_summary(run_dir / 'summary.csv')
        best = max(epochs, key=lambda e: e['eval_top1'])
        record['runs'].append(dict(
            run=run, model=trained['model'], train_command=train,
            test_command=test, epochs=epochs, val_top1=best['eval_top1'], best_epoch=int(best['epoch']),
            test_top1=float(json.loads((run_dir / 'test.json').read_text())['top1']),
        ))
        (out / 'accuracy.json').write_text(json.dumps(record, indent=2) + '\n')
        (out / 'accuracy.md').write_text(markdown(record['runs']))
        plot(record['runs'], out / 'accuracy.png')
    print(markdown(record['runs']))
    return record


if __name__ == '__main__':
    main()
