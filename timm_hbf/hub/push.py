"""Push a train.py checkpoint to the Hugging Face Hub as a timm model repo: timm's ``save_for_hf`` files
(``config.json``, ``model.safetensors``), a model card and its training-curve image, in one commit."""
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Union

import timm
import torch
from huggingface_hub import CommitInfo, EvalResult, HfApi, ModelCard, ModelCardData, constants
from huggingface_hub.errors import HFValidationError, HTTPError
from huggingface_hub.utils import validate_repo_id
from safetensors import SafetensorError
from timm.models import save_for_hf

from .. import __version__
from .train_output import HubError, TrainOutput

__all__ = ['FLOAT32_PARAM_NAMES', 'check_repo_id', 'model_card', 'push_to_hub', 'to_storage_dtype',
           'write_repo_folder']

# Kept in float32 whatever the file's dtype: the kernel widths are exponents (gamma = exp(log_gamma) scales squared
# distances), which bf16 rounding of log_gamma would move by up to a percent, and they are few.
FLOAT32_PARAM_NAMES = ('log_gamma',)
CURVES_FILE = 'training_curves.png'
LOCAL_PATH_KEYS = (  # train.py arguments that are paths of the training machine
    'data', 'data_dir', 'output', 'resume', 'initial_checkpoint', 'pretrained_path', 'class_map', 'cache_dir')
METRICS = {'train_loss': 'train loss', 'eval_loss': 'eval loss', 'eval_top1': 'top-1 (%)', 'eval_top5': 'top-5 (%)'}


def to_storage_dtype(model: torch.nn.Module, dtype: torch.dtype,
                     keep_float32: Sequence[str] = FLOAT32_PARAM_NAMES) -> torch.nn.Module:
    """Cast ``model`` in place to ``dtype`` but for the parameters named ``keep_float32``, kept as they were in
    float32."""
    kept = {n: p.detach().float().clone() for n, p in model.named_parameters() if n.rsplit('.', 1)[-1] in keep_float32}
    model.to(dtype)
    for name, value in kept.items():
        model.get_parameter(name).data = value
    return model


def check_repo_id(repo_id: str) -> str:
    """``repo_id`` if it is a Hub model repo id ``ORG/NAME``, else raises :class:`HubError`."""
    try:
        validate_repo_id(repo_id)
        if repo_id.count('/') == 1:
            return repo_id
    except HFValidationError:
        pass
    raise HubError(f"--repo-id must be ORG/NAME, of letters, digits, '-', '_' and '.' (96 at most), got {repo_id!r}.")


def write_repo_folder(train: TrainOutput, folder: Union[str, Path], repo_id: str,
                      label_names: Optional[Sequence[str]] = None, pytorch_bin: bool = False,
                      dtype: Optional[torch.dtype] = None) -> Path:
    """Write the files of the model repo ``repo_id`` for ``train`` into the new ``folder``, all or nothing: timm's
    ``config.json`` and ``model.safetensors`` (and ``pytorch_model.bin``), ``README.md`` and the training curves of
    its ``summary.csv``. ``dtype``: that of the weights (:func:`to_storage_dtype`); ``label_names``: the classes'."""
    folder = Path(folder)
    if folder.exists():
        raise HubError(f'{folder} already exists: name a new folder.')
    check_repo_id(repo_id)
    model = train.create_model()
    if label_names is not None and len(label_names) != model.num_classes:
        raise HubError(f'--label-names gives {len(label_names)} names for the {model.num_classes} classes.')
    if dtype is not None:
        to_storage_dtype(model, dtype)
    for key in ('tag', 'label_names', 'label_descriptions'):  # of the tag's weights, not these
        model.pretrained_cfg.pop(key, None)
    try:
        folder.mkdir(parents=True)
        # the model's input as built and train.py's evaluation preprocessing (data_config)
        save_for_hf(model, folder, model_config={'label_names': list(label_names)} if label_names else None,
                    data_config=train.args, safe_serialization='both' if pytorch_bin else True)
        # The classes at the top level only: transformers' TimmWrapper passes them to create_model beside model_args,
        # where a second num_classes is an error.
        config = json.loads((folder / 'config.json').read_text())
        config.get('model_args', {}).pop('num_classes', None)
        (folder / 'config.json').write_text(json.dumps(config, indent=2))
        if train.summary:
            plot_training_curves(train, folder / CURVES_FILE, title=f'{repo_id} ({train.arch})')
        model_card(repo_id, model, train, config).save(folder / 'README.md')
    except BaseException as e:
        shutil.rmtree(folder, ignore_errors=True)
        if isinstance(e, (OSError, SafetensorError)):  # a read-only place, a full disk (safetensors' own error)
            raise HubError(f'cannot write {folder}: {e}. Choose a writable folder with free space (TMPDIR for a '
                           'push).') from e
        raise
    return folder


def model_card(repo_id: str, model: torch.nn.Module, train: TrainOutput, config: Dict[str, Any]) -> ModelCard:
    """The card of the repo ``repo_id`` for ``model`` as pushed from ``train`` with timm's ``config`` (config.json):
    Hub metadata, usage, model details, train.py's arguments and metrics."""
    cfg, label_names, args, summary = config['pretrained_cfg'], config.get('label_names'), train.args, train.summary
    pushed = next((row for row in summary if row['epoch'] == train.epoch), None)
    # train.py evaluates the EMA weights where it keeps them off the CPU: are its metrics those of the pushed weights?
    ema_evaluated = bool(args.get('model_ema') and not args.get('model_ema_force_cpu'))
    evaluated = train.ema == ema_evaluated and pushed is not None and 'eval_top1' in pushed
    dataset = args.get('dataset') or 'imagefolder'
    results = [EvalResult(task_type='image-classification', dataset_type=dataset, dataset_name=dataset,
                          dataset_split=args.get('val_split'), metric_type='accuracy',
                          metric_value=pushed['eval_top1'])] if evaluated else None
    data = ModelCardData(library_name='timm', license=cfg.get('license') or 'apache-2.0',
                         pipeline_tag='image-classification', tags=['image-classification', 'timm', 'timm_hbf'],
                         eval_results=results, model_name=repo_id if results else None)
    built = ', '.join(f'{k}={v!r}' for k, v in train.model_kwargs.items() if k not in ('num_classes', 'in_chans'))
    family = ' '.join((sys.modules[type(model).__module__].__doc__ or '').split('\n\n')[0].split())
    classes = f'{model.num_classes}' + (f' ({", ".join(label_names)})' if label_names else '')
    weights = f"{'EMA weights of ' if train.ema else ''}`{train.checkpoint.name}`" + (
        '' if train.epoch is None else f', epoch {train.epoch}')
    show = ("[(model.pretrained_cfg['label_names'][i], p.item()) for p, i in zip(*top)]" if label_names else 'top')
    card = f'''# Model card for {repo_id}

A `{train.arch}` image classifier trained with timm's `train.py` and pushed with timm-hbf, which registers HyperBF and
QIMIA Vision Transformers with [timm](https://github.com/huggingface/pytorch-image-models).

## Usage

```python
import timm
import timm_hbf  # pip install timm-hbf: registers its architectures with timm
from PIL import Image

model = timm.create_model('hf-hub:{repo_id}', pretrained=True).eval()
transform = timm.data.create_transform(**timm.data.resolve_model_data_config(model))
top = model(transform(Image.open('image.jpg').convert('RGB'))[None]).softmax(-1)[0].topk({min(5, model.num_classes)})
print({show})
```

## Model details

- **Architecture:** `{train.arch}`{f' built with `{built}`' if built else ''}: {family}
- **Parameters (M):** {sum(p.numel() for p in model.parameters()) / 1e6:.2f}
- **Image size:** {cfg['input_size'][-2]} x {cfg['input_size'][-1]}
- **Classes:** {classes}
- **Weights:** {weights}; timm-hbf {__version__}, timm {timm.__version__}
'''
    if args:  # those set (0 is a value), without the paths of the training machine
        card += "\n## Training recipe\n\ntimm's `train.py` arguments:\n\n| argument | value |\n|---|---|\n" + ''.join(
            f'| {k} | `{v}` |\n' for k, v in sorted(args.items())
            if k not in LOCAL_PATH_KEYS and v is not False and v not in (None, '', {}, []))
    if summary:
        columns = [k for k in METRICS if k in summary[0]]
        rows = ([('pushed', pushed)] if pushed else []) + ([('last', summary[-1])] if pushed is not summary[-1] else [])
        card += "\n## Results\n\ntrain.py's `summary.csv`" + (
            '.' if evaluated else f', of the {"EMA" if ema_evaluated else "plain"} weights, not those pushed here.')
        card += '\n\n| epoch | ' + ' | '.join(METRICS[k] for k in columns) + ' |\n|---' + '|---' * len(columns) + '|\n'
        for label, row in rows:
            card += f'| {row["epoch"]} ({label}) | ' + ' | '.join(f'{row[k]:.4g}' if k in row else '' for k in columns)
            card += ' |\n'
        card += f'\n![Loss and top-1 accuracy per epoch]({CURVES_FILE})\n'
    return ModelCard(f'---\n{data.to_yaml()}\n---\n\n{card}')


def plot_training_curves(train: TrainOutput, path: Path, title: str) -> None:
    """Draw loss and top-1 accuracy per epoch of train.py's ``summary.csv`` into a PNG at ``path``, the pushed epoch
    marked."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise HubError('Drawing the training curves needs matplotlib: pip install "timm-hbf[hub]".') from e
    fig = Figure(figsize=(8.4, 3.4), layout='constrained')
    fig.suptitle(title)
    panels = (('loss', ('train_loss', 'eval_loss')), ('top-1 (%)', ('eval_top1',)))
    for ax, (label, keys) in zip(fig.subplots(1, 2), panels):
        for key in keys:
            ax.plot([r['epoch'] for r in train.summary], [r.get(key) for r in train.summary], marker='o', label=key)
        if train.epoch is not None:
            ax.axvline(train.epoch, color='0.6', linestyle=':', label=f'pushed (epoch {train.epoch})')
        ax.set(xlabel='epoch', ylabel=label)
        ax.locator_params(axis='x', integer=True)
        ax.legend(fontsize='small')
    fig.savefig(path, format='png', metadata={'Software': None})


def push_to_hub(train: TrainOutput, repo_id: str, label_names: Optional[Sequence[str]] = None, private: bool = False,
                revision: Optional[str] = None, create_pr: bool = False, pytorch_bin: bool = False,
                dtype: Optional[torch.dtype] = None) -> CommitInfo:
    """Push the files of :func:`write_repo_folder` to the Hub repo ``repo_id`` in one commit, to the branch
    ``revision`` (default: main) or, with ``create_pr``, as a pull request; the repo (``private`` if asked) and the
    branch are created if missing."""
    if constants.HF_HUB_OFFLINE:
        raise HubError('Pushing needs the network: unset HF_HUB_OFFLINE (--dry-run writes the files, pushing nothing).')
    api = HfApi(library_name='timm-hbf', library_version=__version__)
    with tempfile.TemporaryDirectory() as tmp:
        # save_for_hf and upload_folder, not timm's push_to_hf_hub: that cannot push the curves nor write a dry run
        folder = write_repo_folder(train, Path(tmp) / 'repo', repo_id, label_names, pytorch_bin, dtype)
        try:
            repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
            if revision is not None:
                api.create_branch(repo_id, branch=revision, exist_ok=True)
            epoch = '' if train.epoch is None else f', epoch {train.epoch}'
            return api.upload_folder(repo_id=repo_id, folder_path=folder, revision=revision, create_pr=create_pr,
                                     commit_message=f'Add {train.arch} weights ({train.checkpoint.name}{epoch})')
        except Exception as err:
            cause = err  # the HTTP or connection error, which the client wraps in a RuntimeError in upload threads
            while cause is not None and not isinstance(cause, (OSError, HTTPError)):
                cause = cause.__cause__
            if cause is None:
                raise
            status = getattr(getattr(cause, 'response', None), 'status_code', None)
            fix = (f'log in with `hf auth login` or set HF_TOKEN to a token that may write to {repo_id.split("/")[0]}'
                   if status in (401, 403) else 'check the network, the proxy and HF_ENDPOINT' if status is None
                   else 'try again later')
            raise HubError(f'Pushing to {repo_id} on {constants.ENDPOINT} failed ({type(cause).__name__}: '
                           f'{str(cause).splitlines()[0]}): {fix}.') from err
