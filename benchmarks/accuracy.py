"""Accuracy through timm's train.py: our models and timm's ViT of the same size trained with one recipe, side by side,
every choice made on a validation split and the test split measured once.

The data folder (ImageFolder layout: ``train/`` and ``test/``, one folder per class) is first split into ``train/``,
``val/`` and ``test/`` of symbolic links: ``--val-per-class`` images of every class of ``train/``, evenly spaced, are
held out as ``val/`` and never trained on. For every model and seed, train.py trains with the recipe on ``train/``,
evaluates on ``val/`` after every epoch and keeps its best checkpoint by that accuracy; validate.py then measures that
checkpoint (its EMA weights where the recipe keeps an EMA) once on ``test/``. Runs go ``--jobs`` at a time (several
can share a GPU), each logging to ``runs/<model>-seed<seed>.log``. Writes into ``--out``: ``accuracy.json`` (device,
versions, command, date, every epoch of every run, the summary), ``accuracy.md`` (the table: mean and standard
deviation over seeds, the test accuracy's ratio to the baseline's) and ``accuracy.png`` (validation top-1 per epoch).

    python benchmarks/accuracy.py --scripts pytorch-image-models --data cifar10 --jobs 3 \\
        --models vit_hyperbf_tiny vit_qimia_tiny vit_tiny_patch16_224 -- --epochs 100
    python benchmarks/accuracy.py --scripts pytorch-image-models --data cifar10 \\
        --recipe timm_hbf/recipes/cifar10/memo143.yaml --baseline vit_base_patch16_224 \\
        --models vit_hyperbf_memo143_patch4_32 vit_qimia_base vit_base_patch16_224
    python benchmarks/accuracy.py --scripts pytorch-image-models --data cifar10 --seeds 0 1 2 \\
        -- --device cpu --epochs 3 --model-kwargs img_size=32 patch_size=4 depth=4        # a short race on a CPU
    python benchmarks/accuracy.py --scripts pytorch-image-models --data cifar10 --seeds 0 1 2 --train-per-class 1000 \\
        --models vit_tiny_patch16_224 vit_qimia_tiny vit_qimia_tiny:keys_from_values=True \\
        vit_qimia_tiny:sublayer_values=True vit_qimia_tiny:depth_num_heads=1 vit_qimia_tiny:memory_block_size=4 \\
        vit_attnres_tiny vit_attnres_block_tiny -- --epochs 3 --model-kwargs img_size=32 patch_size=4 depth=6

``--scripts`` is a checkout of timm's git repository: train.py and validate.py are not installed with timm. Arguments
after ``--`` go to train.py, but for the data's, which are the script's to set (``--epochs 10`` overrides the recipe's
epochs; ``--device cpu`` without a GPU; ``--model-kwargs`` replaces the recipe's). A model ``NAME:KEY=VALUE,...`` is a
variant: its arguments go on top of every run's (the last command: the ablation of attention over depth, 6 layers of
width 192). Run again, the command reads finished runs back (from ``run.json``, ``summary.csv``, ``test.json`` and
``test_command.json``: their checkpoints can be deleted) and resumes interrupted ones from their ``last.pth.tar``; a
run folder made by another command or data split (its ``run.json``) stops it.
"""
import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import timm
import torch
import yaml
from throughput import check_counts  # the speed benchmark's, beside this script

import timm_hbf
from timm_hbf.hub import read_summary

ROOT = Path(__file__).resolve().parents[1]
SHORT_RECIPE = Path(timm_hbf.__file__).resolve().parent / 'recipes' / 'cifar10' / 'short.yaml'
IMAGE_SUFFIXES = ('.png', '.jpg', '.jpeg', '.bmp', '.webp')
SCRIPT_ENV = dict(os.environ, PYTHONUNBUFFERED='1')  # the scripts' logs as they go
SPLIT_ARGS = ('--data-dir', '--dataset', '--train-split', '--val-split')  # train.py's options this script sets


def split_data(source: Path, test_split: str, dest: Path, val_per_class: int,
               train_per_class: Optional[int] = None) -> Path:
    """``dest/{train,val,test}`` as symbolic links into ``source``: ``val_per_class`` images of every class of
    ``source/train``, evenly spaced in name order, go to ``val``, and the rest (or ``train_per_class`` of them, evenly
    spaced) to ``train``; ``test`` is ``source/<test_split>`` as it is. Made anew on every call, the same for the same
    arguments."""
    if not (source / 'train').is_dir() or not (source / test_split).is_dir():
        raise SystemExit(f'--data {source}: expected an ImageFolder layout with train/ and {test_split}/ folders '
                         '(give the folder that holds them; --test-split names another one than test/).')
    if dest.exists():
        check_made_here(source, dest)
        shutil.rmtree(dest)  # links only: a split of other arguments must not linger
    for class_dir in sorted(p for p in (source / 'train').iterdir() if p.is_dir()):
        images = sorted(p for p in class_dir.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if val_per_class >= len(images):
            raise SystemExit(f'--val-per-class {val_per_class} leaves no training image of class {class_dir.name} '
                             f'({len(images)} images): give fewer.')
        held_out = [images[i * len(images) // val_per_class] for i in range(val_per_class)]
        rest = sorted(set(images) - set(held_out))
        count = len(rest) if train_per_class is None else min(train_per_class, len(rest))
        for split, chosen in (('val', held_out), ('train', [rest[i * len(rest) // count] for i in range(count)])):
            (dest / split / class_dir.name).mkdir(parents=True)
            for image in chosen:
                (dest / split / class_dir.name / image.name).symlink_to(image.resolve())
    (dest / 'test').symlink_to((source / test_split).resolve(), target_is_directory=True)
    return dest


def check_made_here(source: Path, dest: Path) -> None:
    """Stops unless ``dest`` is a split :func:`split_data` made (folders of symbolic links) that ``source`` does not
    lie in: that alone may be deleted and made anew."""
    if source.resolve() == dest.resolve() or dest.resolve() in source.resolve().parents:
        raise SystemExit(f'--data {source} lies in {dest}, where the script writes its split: give --data outside it '
                         'or another --out.')
    for folder, _, files in os.walk(dest):
        kept = [name for name in files if not (Path(folder) / name).is_symlink()]
        if kept:
            raise SystemExit(f'--out: {dest} holds files this script did not make ({Path(folder) / kept[0]}); it '
                             'makes that folder anew, links only. Give another --out or move them away.')


def model_spec(spec: str) -> Tuple[str, Dict[str, str]]:
    """``NAME`` or ``NAME:KEY=VALUE[,KEY=VALUE...]``: a registered model, or one built with arguments of its own (an
    ablation's variant, such as ``vit_qimia_tiny:keys_from_values=True``)."""
    name, _, options = spec.partition(':')
    pairs = [option.split('=', 1) for option in options.split(',') if option]
    if not name or any(len(pair) != 2 or not pair[0] for pair in pairs):
        raise ValueError(f'--models {spec}: expected NAME or NAME:KEY=VALUE[,KEY=VALUE...], such as '
                         'vit_qimia_tiny:keys_from_values=True,depth_num_heads=1')
    return name, dict(pairs)


def given_model_kwargs(args) -> Dict[str, str]:
    """The model arguments every run gets: the recipe's, replaced by a ``--model-kwargs`` given after ``--`` (as
    train.py replaces them)."""
    kwargs = {k: str(v) for k, v in (yaml.safe_load(Path(args.recipe).read_text()).get('model_kwargs') or {}).items()}
    if '--model-kwargs' in args.train_args:
        start = args.train_args.index('--model-kwargs') + 1
        end = next((i for i in range(start, len(args.train_args)) if args.train_args[i].startswith('--')),
                   len(args.train_args))
        kwargs = dict(option.split('=', 1) for option in args.train_args[start:end])
    return kwargs


def train_command(args, model: str, seed: int, data: Path, experiment: str) -> List[str]:
    """train.py's command line; a variant's arguments go on top of every run's (one ``--model-kwargs``, last)."""
    name, variant = model_spec(model)
    own = ['--model-kwargs', *(f'{k}={v}' for k, v in {**given_model_kwargs(args), **variant}.items())] \
        if variant else []
    return [sys.executable, str(Path(args.scripts) / 'train.py'), '-c', str(args.recipe),
            '--model', name, '--seed', str(seed), '--data-dir', str(data), '--train-split', 'train',
            '--val-split', 'val', '--output', str(Path(args.out) / 'runs'), '--experiment', experiment,
            *args.train_args, *own]


def test_command(args, run_dir: Path, data: Path, trained: Dict, checkpoint: Path) -> List[str]:
    """validate.py on the test split with the model, preprocessing and device of the run (``trained``: train.py's
    ``args.yaml``, so that options given after ``--`` count) and its best checkpoint."""
    options = ['--model', trained['model'], '--num-classes', str(trained['num_classes']),
               '--img-size', str(trained['img_size']), '--crop-pct', str(trained['crop_pct']),
               '--mean', *map(str, trained['mean']), '--std', *map(str, trained['std']), '--device', trained['device']]
    if trained.get('model_kwargs'):
        options += ['--model-kwargs', *(f'{k}={v}' for k, v in trained['model_kwargs'].items())]
    if trained.get('model_ema'):
        options.append('--use-ema')
    return [sys.executable, str(Path(args.scripts) / 'validate.py'), '--data-dir', str(data),
            '--split', 'test', '--checkpoint', str(checkpoint), *options,
            '--results-file', str(run_dir / 'test.json'), '--results-format', 'json']


def run_folder(args, model: str, seed: int) -> Tuple[str, Path]:
    """The experiment name of a run and its train.py output folder."""
    experiment = f"{model.replace(':', '+').replace(',', '+')}-seed{seed}"
    return experiment, Path(args.out) / 'runs' / experiment


def recorded_as(args, model: str, seed: int, data: Path) -> Dict:
    """What a run's folder records of how it was made (``run.json``): its train.py command and the data split."""
    return dict(train_command=train_command(args, model, seed, data, run_folder(args, model, seed)[0]),
                data=str(Path(args.data).resolve()), val_per_class=args.val_per_class,
                train_per_class=args.train_per_class)


def check_earlier_run(args, model: str, seed: int, data: Path) -> None:
    """Stop, before anything runs or is written, where the run's folder holds a run made otherwise."""
    recorded = run_folder(args, model, seed)[1] / 'run.json'
    if recorded.is_file() and json.loads(recorded.read_text()) != recorded_as(args, model, seed, data):
        raise SystemExit(f'{recorded.parent} holds a run of another command or data split (see its run.json): remove '
                         'it or choose another --out.')


def run(args, model: str, seed: int, data: Path) -> Dict:
    """Train one model with one seed, then test its best checkpoint; the commands, every epoch and the accuracies.

    A run of the same command that finished before (its folder holds the test result) is read back, from its records
    alone once its test command is recorded (``test_command.json``); one that was cut short resumes from its
    ``last.pth.tar``, or starts again where it has none (:func:`check_earlier_run` first)."""
    experiment, run_dir = run_folder(args, model, seed)
    log = run_dir.parent / f'{run_dir.name}.log'  # not with_suffix: a variant's name may hold a '.'
    train = train_command(args, model, seed, data, experiment)
    finished = (run_dir / 'test.json').is_file()
    if not finished:
        resume = ['--resume', str(run_dir / 'last.pth.tar')] if (run_dir / 'last.pth.tar').is_file() else []
        if not resume and run_dir.exists():
            shutil.rmtree(run_dir)  # no checkpoint: nothing to resume from
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / 'run.json').write_text(json.dumps(recorded_as(args, model, seed, data)))
        print(f'--- {experiment}: {" ".join(train + resume)}  (log: {log})', flush=True)
        with open(log, 'a' if resume else 'w') as f:
            if subprocess.run(train + resume, stdout=f, stderr=subprocess.STDOUT, env=SCRIPT_ENV).returncode:
                raise RuntimeError(f'{experiment}: train.py failed, see {log}')
    epochs = read_summary(run_dir / 'summary.csv')
    tested = run_dir / 'test_command.json'  # with it a finished run reads back with its checkpoints deleted
    if finished and tested.is_file():
        best_epoch, test = best_on_validation(epochs), json.loads(tested.read_text())
    else:
        best_epoch, checkpoint = best_checkpoint(run_dir, epochs, experiment)
        test = test_command(args, run_dir, data, yaml.safe_load((run_dir / 'args.yaml').read_text()), checkpoint)
    if not finished:
        with open(log, 'a') as f:
            if subprocess.run(test, stdout=f, stderr=subprocess.STDOUT, env=SCRIPT_ENV).returncode:
                raise RuntimeError(f'{experiment}: validate.py failed, see {log}')
        tested.write_text(json.dumps(test))
    result = dict(model=model, seed=seed, train_command=train, test_command=test, epochs=epochs,
                  val_top1=next(e['eval_top1'] for e in epochs if e['epoch'] == best_epoch), best_epoch=best_epoch,
                  test_top1=float(json.loads((run_dir / 'test.json').read_text())['top1']))
    print(f"--- {experiment}: validation {result['val_top1']:.2f} % (epoch {result['best_epoch']}), "
          f"test {result['test_top1']:.2f} %", flush=True)
    return result


def best_on_validation(epochs: List[Dict]) -> int:
    """The run's best epoch by validation top-1, the first of a tie, as train.py keeps it."""
    return max(epochs, key=lambda e: e['eval_top1'])['epoch']


def checkpoint_epoch(path: Path) -> int:
    """The epoch a train.py checkpoint was saved at, read weights only (its arguments are an argparse.Namespace)."""
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(path, map_location='cpu', weights_only=True)['epoch']


def best_checkpoint(run_dir: Path, epochs: List[Dict], experiment: str) -> Tuple[int, Path]:
    """The run's best epoch and its checkpoint: ``model_best.pth.tar``, or, where a resume started train.py's choice
    afresh (its best is then the best since the resume), that epoch's ``checkpoint-N.pth.tar``, which train.py keeps
    among its ``--checkpoint-hist`` best."""
    best = best_on_validation(epochs)
    for path in (run_dir / 'model_best.pth.tar', run_dir / f'checkpoint-{best}.pth.tar'):
        if path.is_file() and checkpoint_epoch(path) == best:
            return best, path
    raise RuntimeError(f'{experiment}: no checkpoint of epoch {best}, the best on the validation split (train.py '
                       f'kept another as model_best after a resume, and deleted it): train the run again (remove '
                       f'{run_dir}) or raise --checkpoint-hist.')


def summarise(runs: List[Dict], baseline: str) -> Dict[str, Dict]:
    """Per model: mean and sample standard deviation over seeds of validation and test top-1, and the ratio of its
    mean test top-1 to the baseline's (where the baseline ran)."""
    summary = {}
    for model in dict.fromkeys(r['model'] for r in runs):
        mine = [r for r in runs if r['model'] == model]
        summary[model] = {metric: dict(mean=statistics.mean(r[metric] for r in mine),
                                       std=statistics.stdev(r[metric] for r in mine) if len(mine) > 1 else 0.)
                          for metric in ('val_top1', 'test_top1')}
        summary[model]['seeds'] = len(mine)
    for row in summary.values():
        row['test_ratio_to_baseline'] = \
            row['test_top1']['mean'] / summary[baseline]['test_top1']['mean'] if baseline in summary else None
    return summary


def markdown(summary: Dict[str, Dict], baseline: str) -> str:
    lines = ['| model | seeds | validation top-1 (%) | test top-1 (%) | test ratio to the baseline |',
             '|---|---|---|---|---|']
    for model, row in summary.items():
        val, test, ratio = row['val_top1'], row['test_top1'], row['test_ratio_to_baseline']
        lines.append(f"| `{model}`{' (baseline)' if model == baseline else ''} | {row['seeds']} | "
                     f"{val['mean']:.2f} ± {val['std']:.2f} | {test['mean']:.2f} ± {test['std']:.2f} | "
                     f"{'' if ratio is None else format(ratio, '.3f')} |")
    return '\n'.join(lines) + '\n'


def plot(runs: List[Dict], title: str, path: Path) -> None:
    """Validation top-1 per epoch: one line per model, the mean over its seeds, shaded from the lowest to the highest
    seed (epochs that every seed of the model reached)."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    by_model: Dict[str, List[Dict[int, float]]] = {}
    for r in runs:
        by_model.setdefault(r['model'], []).append({e['epoch'] + 1: e['eval_top1'] for e in r['epochs']})
    fig, ax = plt.subplots(figsize=(7.5, 3.6), dpi=120)
    for model, seeds in by_model.items():
        epochs = sorted(set.intersection(*(set(s) for s in seeds)))
        top1 = [[s[e] for s in seeds] for e in epochs]
        line, = ax.plot(epochs, [sum(t) / len(t) for t in top1], marker='.', label=f'{model} ({len(seeds)} seeds)')
        if len(seeds) > 1:
            ax.fill_between(epochs, [min(t) for t in top1], [max(t) for t in top1], color=line.get_color(), alpha=.15)
    ax.set(xlabel='epoch', ylabel='validation top-1 (%)', title=title)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.title.set_fontsize(8)
    if by_model:  # no run finished: an empty plot
        ax.legend(fontsize=6, loc='upper left', bbox_to_anchor=(1.01, 1.))
    ax.grid(alpha=.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``parser.error`` (exit status 2, the usage line) for the first argument the runs cannot start with, before any
    data is split."""
    owned = [a for a in args.train_args if a.split('=', 1)[0] in SPLIT_ARGS]
    if owned:
        parser.error(f'{" ".join(owned)} after --: the script splits the data itself (train/, val/ held out of '
                     f'the training images, {args.test_split}/ measured once); give --data and --test-split.')
    for script in ('train.py', 'validate.py'):
        if not (Path(args.scripts) / script).is_file():
            parser.error(f"--scripts {args.scripts}: no {script}. It is in timm's git repository: "
                         'git clone https://github.com/huggingface/pytorch-image-models')
    if not Path(args.recipe).is_file():
        parser.error(f'--recipe {args.recipe}: no such file (the recipes are in {SHORT_RECIPE.parents[1]}).')
    for model in args.models:
        try:
            name, _ = model_spec(model)
        except ValueError as e:
            parser.error(str(e))
        if not timm.is_model(name):
            parser.error(f'--models {model}: timm has no model {name} (timm.list_models() lists those it has, '
                         'ours among them).')
    check_counts(parser, args, jobs=1, val_per_class=1, train_per_class=1)


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    given = list(sys.argv[1:] if argv is None else argv)
    split = given.index('--') if '--' in given else len(given)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--scripts', required=True, help="a checkout of timm's repository (train.py, validate.py)")
    parser.add_argument('--data', required=True, help='ImageFolder dataset with train/ and test/')
    parser.add_argument('--test-split', default='test', help='the folder measured once (default: %(default)s)')
    parser.add_argument('--recipe', default=str(SHORT_RECIPE), help='train.py config (default: %(default)s)')
    parser.add_argument('--models', nargs='+', default=['vit_hyperbf_tiny', 'vit_qimia_tiny', 'vit_tiny_patch16_224'],
                        help='NAME, or NAME:KEY=VALUE[,KEY=VALUE...] for a variant with arguments of its own')
    parser.add_argument('--baseline', default='vit_tiny_patch16_224', help='the model the ratios are to')
    parser.add_argument('--seeds', type=int, nargs='+', default=[42])
    parser.add_argument('--val-per-class', type=int, default=500, help='train images of every class held out')
    parser.add_argument('--train-per-class', type=int, help='train on this many images of every class (default: all)')
    parser.add_argument('--jobs', type=int, default=1, help='runs at a time')
    parser.add_argument('--out', default=str(ROOT / 'benchmarks' / 'results' / 'accuracy'))
    args = parser.parse_args(given[:split])
    args.train_args = given[split + 1:]
    check_arguments(parser, args)
    out = Path(args.out)
    if (out / 'data').exists():  # before an earlier run's records are read against it
        check_made_here(Path(args.data), out / 'data')
    for seed in args.seeds:
        for model in args.models:
            check_earlier_run(args, model, seed, out / 'data')
    data = split_data(Path(args.data), args.test_split, out / 'data', args.val_per_class, args.train_per_class)
    cuda = torch.cuda.is_available() and '--device' not in args.train_args
    record = dict(
        date=datetime.now(timezone.utc).isoformat(timespec='seconds'),
        command=' '.join(['python', 'benchmarks/accuracy.py', *given]),
        device=torch.cuda.get_device_name() if cuda else f'CPU ({platform.processor() or platform.machine()})',
        versions=dict(torch=torch.__version__, cuda=torch.version.cuda, timm=timm.__version__,
                      timm_hbf=timm_hbf.__version__, python=platform.python_version()),
        recipe=yaml.safe_load(Path(args.recipe).read_text()), val_per_class=args.val_per_class,
        train_per_class=args.train_per_class,
    )
    record['runs'], failed = [], []
    with ThreadPoolExecutor(args.jobs) as pool:  # a failed run is reported at the end; the others go on
        for future in [pool.submit(run, args, model, seed, data) for seed in args.seeds for model in args.models]:
            try:
                record['runs'].append(future.result())
            except RuntimeError as e:
                failed.append(str(e))
    if not record['runs']:  # what an earlier call wrote stays
        raise SystemExit('\n'.join(failed))
    record['summary'] = summarise(record['runs'], args.baseline)
    table = markdown(record['summary'], args.baseline)
    (out / 'accuracy.json').write_text(json.dumps(record, indent=2) + '\n')
    (out / 'accuracy.md').write_text(f"`{record['command']}`\n\n{record['device']}, {record['date']}\n\n{table}")
    plot(record['runs'], f"{Path(args.recipe).name}, {record['device']}", out / 'accuracy.png')
    print(table)
    if failed:
        raise SystemExit('\n'.join(failed))
    return record


if __name__ == '__main__':
    main()
