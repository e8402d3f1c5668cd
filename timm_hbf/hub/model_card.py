"""The model card (README.md) of a pushed checkpoint and its training-curve image."""
import inspect
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import timm
import yaml
from torch import nn

from .. import __version__
from .errors import HubError
from .train_output import TrainOutput

__all__ = ['CURVES_FILE', 'model_card', 'plot_training_curves']

CURVES_FILE = 'training_curves.png'
# train.py arguments shown in the card's recipe table, in this order, when set
RECIPE_KEYS = (
    'dataset', 'train_split', 'val_split', 'model_kwargs', 'pretrained', 'epochs', 'batch_size', 'grad_accum_steps',
    'opt', 'lr', 'weight_decay', 'layer_decay', 'sched', 'warmup_epochs', 'min_lr', 'clip_grad', 'smoothing', 'mixup',
    'cutmix', 'aa', 'reprob', 'drop', 'drop_path', 'model_ema', 'model_ema_decay', 'amp', 'amp_dtype', 'seed',
)
# train.py arguments that hold paths on the training machine: not published
LOCAL_PATH_KEYS = (
    'data', 'data_dir', 'output', 'resume', 'initial_checkpoint', 'pretrained_path', 'class_map', 'cache_dir')
METRICS = {'train_loss': 'train loss', 'eval_loss': 'eval loss', 'eval_top1': 'top-1 (%)', 'eval_top5': 'top-5 (%)'}
# panels of the training-curve image: y label, then (summary.csv column, legend, colour) per curve
CURVE_PANELS = (('loss', (('train_loss', 'train', 'tab:blue'), ('eval_loss', 'eval', 'tab:orange'))),
                ('top-1 (%)', (('eval_top1', 'eval', 'tab:orange'),)))


def model_card(repo_id: str, model: nn.Module, train: TrainOutput, label_names: Optional[Sequence[str]] = None) -> str:
    """The Markdown of the model card of the repo ``repo_id`` for ``model`` as pushed from ``train``: Hub metadata,
    usage, architecture and paper, recipe, metrics and the training-curve image (:data:`CURVES_FILE`, pushed beside
    the card when the run has a ``summary.csv``); ``label_names`` are the class names, in classifier order."""
    front = {'library_name': 'timm', 'license': model.pretrained_cfg.get('license') or 'apache-2.0',
             'pipeline_tag': 'image-classification', 'tags': ['image-classification', 'timm', 'timm_hbf']}
    sections = [
        '---\n' + yaml.safe_dump(front, sort_keys=False) + '---',
        f'# Model card for {repo_id}',
        f'A `{train.arch}` image classifier trained with timm\'s `train.py` and pushed with timm-hbf, which '
        'registers HyperBF and QIMIA Vision Transformers with '
        '[timm](https://github.com/huggingface/pytorch-image-models).',
        _usage(repo_id, label_names, model.num_classes),
        _details(train, model, label_names),
        _recipe(train.args),
        _results(train),
    ]
    return '\n\n'.join(s for s in sections if s) + '\n'


def plot_training_curves(summary: List[Dict[str, float]], path: Path, title: str, epoch: Optional[int] = None) -> None:
    """Draw loss and top-1 accuracy per epoch from train.py's ``summary.csv`` rows into a PNG at ``path``, titled
    ``title``, with ``epoch`` (that of the pushed weights) marked."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as e:
        raise HubError('Drawing the training curves needs matplotlib: pip install "timm-hbf[hub]".') from e
    panels = [(label, shown) for label, curves in CURVE_PANELS if (shown := [c for c in curves if c[0] in summary[0]])]
    epochs = [row['epoch'] for row in summary]
    fig = Figure(figsize=(4.2 * len(panels), 3.4), dpi=100, layout='constrained')
    fig.suptitle(title)
    for ax, (label, curves) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        for key, legend, color in curves:
            ax.plot(epochs, [row[key] for row in summary], color=color, marker='o', markersize=3, label=legend)
        if epoch is not None:
            ax.axvline(epoch, color='0.6', linestyle=':', label=f'pushed (epoch {epoch})')
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(xlabel='epoch', ylabel=label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize='small')
    fig.savefig(path, format='png', metadata={'Software': None})


def _usage(repo_id: str, label_names: Optional[Sequence[str]], num_classes: int) -> str:
    labels = ("\nlabels = model.pretrained_cfg['label_names']\n"
              "print([(labels[i], p.item()) for p, i in zip(*top)])") if label_names else '\nprint(top)'
    return f'''## Usage

```bash
pip install timm-hbf
```

```python
import timm
import timm_hbf  # registers the timm-hbf architectures with timm
import torch
from PIL import Image

model = timm.create_model('hf-hub:{repo_id}', pretrained=True).eval()
transform = timm.data.create_transform(**timm.data.resolve_model_data_config(model), is_training=False)

image = Image.open('image.jpg').convert('RGB')
with torch.no_grad():
    top = model(transform(image).unsqueeze(0)).softmax(-1)[0].topk({min(5, num_classes)}){labels}
```

Fine-tune on other data with `timm.create_model('hf-hub:{repo_id}', pretrained=True, num_classes=N)`
(`in_chans` and `img_size` adapt too); pin a commit with `hf-hub:{repo_id}@<commit>`.'''


def _details(train: TrainOutput, model: nn.Module, label_names: Optional[Sequence[str]]) -> str:
    cfg, entrypoint = model.pretrained_cfg, timm.models.model_entrypoint(train.arch)
    family, paper = _first_paragraph(sys.modules[type(model).__module__].__doc__), cfg.get('paper_name')
    architecture = f'`{train.arch}`' + (f': {_first_paragraph(entrypoint.__doc__)}' if entrypoint.__doc__ else '')
    built = [f'{k}={v!r}' for k, v in train.model_kwargs.items() if k not in ('num_classes', 'in_chans')]
    if built:
        architecture += f' Built with `{", ".join(built)}`.'
    lines = [
        f'- **Architecture:** {architecture}',
        f'- **Family:** {family}' if family else '',
        f'- **Paper:** {paper}' if paper and paper not in family else '',
        f'- **Parameters (M):** {sum(p.numel() for p in model.parameters()) / 1e6:.2f}',
        f'- **Image size:** {cfg["input_size"][-2]} x {cfg["input_size"][-1]}',
        f'- **Classes:** {model.num_classes}' + (f' ({", ".join(label_names)})' if label_names else ''),
        f'- **Weights:** {"EMA weights of " if train.ema else ""}`{train.checkpoint.name}`'
        + (f', epoch {train.epoch}' if train.epoch is not None else ''),
        f'- **Software:** timm-hbf {__version__}, timm {timm.__version__}',
    ]
    return '## Model details\n\n' + '\n'.join(line for line in lines if line)


def _recipe(args: Dict[str, Any]) -> str:
    if not args:
        return ''
    # arguments left at nothing or off are not shown; 0 is a value (a seed, no weight decay)
    rows = '\n'.join(f'| {k} | `{args[k]}` |' for k in RECIPE_KEYS
                     if args.get(k) not in (None, '', {}) and args[k] is not False)
    published = yaml.safe_dump({k: v for k, v in args.items() if k not in LOCAL_PATH_KEYS}, sort_keys=True).rstrip()
    return (f"## Training recipe\n\ntimm's `train.py` arguments (`args.yaml`):\n\n| argument | value |\n|---|---|\n"
            f'{rows}\n\n<details><summary>All arguments (paths on the training machine left out)</summary>\n\n'
            f'```yaml\n{published}\n```\n\n</details>')


def _results(train: TrainOutput) -> str:
    if not train.summary:
        return ''
    last, ema, on_cpu = train.summary[-1], train.args.get('model_ema'), train.args.get('model_ema_force_cpu')
    pushed = next((row for row in train.summary if row['epoch'] == train.epoch), None)
    note = ''
    if ema and on_cpu:  # train.py does not evaluate EMA weights kept on the CPU
        note = (' The run kept EMA weights on the CPU (`--model-ema-force-cpu`), which train.py does not evaluate: '
                'the metrics are those of the plain weights, '
                + ('not of the EMA weights pushed here.' if train.ema else 'the weights pushed here.'))
    elif ema:
        note = (' The run kept EMA weights (`--model-ema`), and train.py evaluated those: '
                + ('the weights pushed here.' if train.ema else 'push with `--ema` to publish those.'))
    # where train.py evaluated the EMA weights, an epoch's metrics describe these weights only if they are those
    label = 'this epoch (EMA weights)' if ema and not on_cpu and not train.ema else 'these weights'
    rows = ([(label, pushed)] if pushed is not None else []) + ([('last epoch', last)] if pushed is not last else [])
    columns = [k for k in METRICS if k in train.summary[0]]
    return '\n'.join([
        '## Results', '', "From train.py's `summary.csv`." + note, '',
        '| | epoch | ' + ' | '.join(METRICS[k] for k in columns) + ' |',
        '|---|---' + '|---' * len(columns) + '|',
        *[f'| {label} | {row["epoch"]} | ' + ' | '.join('' if row.get(k) is None else f'{row[k]:.4g}' for k in columns)
          + ' |' for label, row in rows],
        '', f'![Loss and top-1 accuracy per epoch]({CURVES_FILE})',
    ])


def _first_paragraph(doc: Optional[str]) -> str:
    return ' '.join(inspect.cleandoc(doc or '').split('\n\n')[0].split())
