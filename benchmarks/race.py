"""CPU accuracy race: HyperBF, QIMIA and timm's residual ViT at the same small size, trained on the same real
CIFAR-10 images with the same budget and recipe, over several seeds.

Every run is ``examples/train_cifar10.py`` (timm's data pipeline, AdamW, warmup + cosine, label smoothing, EMA) with
a validation split held out from the train images: choices belong on the validation accuracy, the test accuracy is
reported beside it. Writes ``race.json`` (every run, the summary, device, versions and command), ``race.md`` (the
table: mean +- std over seeds and the ratio to the ViT) and ``race.png`` into ``--out``.

    python benchmarks/race.py                        # the README table: depth 4, 3 seeds, about 30 min on 2 cores
    python benchmarks/race.py --seeds 0 --epochs 1   # a quick look
"""
import argparse
import importlib.util
import json
import platform
import statistics
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Dict, List

import timm
import torch

import timm_hbf

ROOT = Path(__file__).resolve().parents[1]
BASELINE = 'vit'
# name in the table -> (timm model, its create_model kwargs besides depth): the same width, heads, patch and input,
# and the same input normalisation (CIFAR-10's mean and std, which our 32 x 32 models carry in their pretrained_cfg)
CIFAR10_NORM = "pretrained_cfg_overlay={'mean': (0.4914, 0.4822, 0.4465), 'std': (0.2470, 0.2435, 0.2616)}"
CONTENDERS = {
    BASELINE: ('vit_tiny_patch16_224', ['img_size=32', 'patch_size=4', CIFAR10_NORM]),
    'hyperbf': ('vit_hyperbf_tiny', []),
    'qimia': ('vit_qimia_tiny', []),
}


def load_trainer():
    spec = importlib.util.spec_from_file_location('train_cifar10', ROOT / 'examples' / 'train_cifar10.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def summarise(runs: List[Dict]) -> Dict[str, Dict]:
    """Mean and sample std over seeds of validation and test top-1 per contender, and the ratio of its mean to the
    baseline's (when the baseline ran)."""
    summary = {}
    for name in dict.fromkeys(run['name'] for run in runs):
        mine = [run for run in runs if run['name'] == name]
        summary[name] = {
            metric: dict(mean=statistics.mean(r[metric] for r in mine),
                         std=statistics.stdev(r[metric] for r in mine) if len(mine) > 1 else 0.)
            for metric in ('val_top1', 'top1', 'train_s')
        }
        summary[name]['seeds'] = len(mine)
    if BASELINE in summary:
        for name, row in summary.items():
            for metric in ('val_top1', 'top1'):
                row[metric]['ratio'] = row[metric]['mean'] / summary[BASELINE][metric]['mean']
    return summary


def markdown(summary: Dict[str, Dict], models: Dict[str, str]) -> str:
    lines = ['| contender | model | seeds | validation top-1 (%) | test top-1 (%) | test ratio to ViT | train s |',
             '|---|---|---|---|---|---|---|']
    for name, row in summary.items():
        val, test = row['val_top1'], row['top1']
        ratio = f"{test['ratio']:.3f}" if 'ratio' in test else '-'
        lines.append(f"| {name} | `{models[name]}` | {row['seeds']} | {val['mean']:.2f} ± {val['std']:.2f} | "
                     f"{test['mean']:.2f} ± {test['std']:.2f} | {ratio} | {row['train_s']['mean']:.0f} |")
    return '\n'.join(lines) + '\n'


def plot(runs: List[Dict], summary: Dict[str, Dict], path: Path) -> None:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=120)
    for i, name in enumerate(names):
        for offset, metric, color in ((-.18, 'val_top1', 'tab:blue'), (.18, 'top1', 'tab:orange')):
            row = summary[name][metric]
            ax.bar(i + offset, row['mean'], .34, yerr=row['std'], color=color, capsize=3,
                   label=('validation' if metric == 'val_top1' else 'test') if i == 0 else None)
            seeds = [run[metric] for run in runs if run['name'] == name]
            ax.plot([i + offset] * len(seeds), seeds, 'k.', ms=4)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel('top-1 (%)')
    ax.set_title('CIFAR-10, same size and budget, mean ± std over seeds', fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> Dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--contenders', nargs='+', default=list(CONTENDERS), choices=list(CONTENDERS))
    parser.add_argument('--depth', type=int, default=4)
    parser.add_argument('--seeds', type=int, nargs='+', default=[0, 1, 2])
    parser.add_argument('--epochs', type=int, default=3)
    parser.add_argument('--train-images', type=int, default=4096, help='train images per epoch')
    parser.add_argument('--val-images', type=int, default=2000, help='held out from the train split')
    parser.add_argument('--test-images', type=int, default=5000)
    parser.add_argument('--threads', type=int, help='torch CPU threads (default: torch default)')
    parser.add_argument('--data', help='CIFAR-10 archive or folder (default: the training example\'s)')
    parser.add_argument('--cache-dir', help='where the archive is extracted (default: the training example\'s)')
    parser.add_argument('--out', default=str(ROOT / 'benchmarks' / 'results' / 'race_cpu'))
    args = parser.parse_args(argv)

    trainer = load_trainer()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = {name: CONTENDERS[name][0] for name in args.contenders}
    runs = []
    with tempfile.TemporaryDirectory() as checkpoints:
        for seed in args.seeds:  # seed-major, so that an interrupted race still has every contender
            for name in args.contenders:
                model, kwargs = CONTENDERS[name]
                run_argv = [
                    '--model', model, '--model-kwargs', f'depth={args.depth}', *kwargs, '--seed', str(seed),
                    '--epochs', str(args.epochs), '--train-images', str(args.train_images),
                    '--val-images', str(args.val_images), '--test-images', str(args.test_images),
                    '--output', checkpoints,
                    *(['--threads', str(args.threads)] if args.threads else []),
                    *(['--data', args.data] if args.data else []),
                    *(['--cache-dir', args.cache_dir] if args.cache_dir else []),
                ]
                print(f'--- {name} seed {seed}: train_cifar10.py {" ".join(run_argv)}', flush=True)
                result = trainer.main(run_argv)
                runs.append(dict(name=name, model=model, seed=seed, argv=run_argv, top1=result['top1'],
                                 val_top1=result['val_top1'], train_s=result['train_s']))
                summary = summarise(runs)
                record = dict(
                    date=datetime.now(timezone.utc).isoformat(timespec='seconds'),
                    command=' '.join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
                    device=f'CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)',
                    versions=dict(torch=torch.__version__, timm=timm.__version__, timm_hbf=timm_hbf.__version__,
                                  python=platform.python_version()),
                    setup=dict(depth=args.depth, epochs=args.epochs, train_images=args.train_images,
                               val_images=args.val_images, test_images=args.test_images, models=models),
                    runs=runs, summary=summary,
                )
                (out / 'race.json').write_text(json.dumps(record, indent=2) + '\n')
                (out / 'race.md').write_text(markdown(summary, models))
    plot(runs, summary, out / 'race.png')
    print(markdown(summary, models))
    return record


if __name__ == '__main__':
    main()
