"""What timm's train.py leaves in its output folder: checkpoints, ``args.yaml`` (its arguments) and ``summary.csv``
(one row of metrics per epoch), read without running any code from the files (timm's weights-only reading)."""
import argparse
import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import timm
import torch
import yaml
from timm.models import get_pretrained_cfg

from ..models import PretrainedWeightsError, read_weights, state_dict_mismatch
from .errors import HubError

__all__ = ['TrainOutput', 'read_summary', 'read_train_output']

CHECKPOINT_NAMES = ('model_best.pth.tar', 'last.pth.tar')  # what a folder stands for, in order of preference


@dataclass
class TrainOutput:
    """A checkpoint (its ``arch``, the ``model_kwargs`` that rebuild it, its weights, EMA or not, and ``epoch``) with
    train.py's ``args`` (``args.yaml``, else those in the checkpoint) and ``summary`` (``summary.csv``, a dict of
    numbers per epoch), each empty if unknown; for messages, where ``arch`` and the model arguments come from
    (``'--model'``, ``'--model-kwargs'``, the file that names them, or None)."""
    checkpoint: Path
    arch: str
    model_kwargs: Dict[str, Any]
    state_dict: Dict[str, torch.Tensor]
    ema: bool
    epoch: Optional[int]
    args: Dict[str, Any]
    summary: List[Dict[str, float]]
    arch_source: Optional[str] = None
    model_kwargs_source: Optional[str] = None

    def create_model(self) -> torch.nn.Module:
        """The model with the checkpoint's weights, in eval mode."""
        try:
            model = timm.create_model(self.arch, **self.model_kwargs)
        except (TypeError, ValueError) as e:  # an argument the model does not take, or a value it refuses
            raise self._error(f'{self.arch} cannot be built with {self.model_kwargs}', e) from e
        mismatch = state_dict_mismatch(model.state_dict(), self.state_dict)
        if mismatch:
            raise self._error(f'{self.checkpoint} does not fit {self.arch} built with {self.model_kwargs}', mismatch)
        model.load_state_dict(self.state_dict)
        return model.eval()

    def _error(self, problem: str, detail: Any) -> HubError:
        """``problem`` and its ``detail``, saying where the model arguments come from and how to give the right ones."""
        source = self.model_kwargs_source
        origin = ('no model arguments: neither the checkpoint nor an args.yaml beside it records them' if source is None
                  else 'the model arguments given with --model-kwargs' if source == '--model-kwargs'
                  else f'the model arguments of {source}')
        arch = ('check --model too' if self.arch_source == '--model' else f'if it was not trained as {self.arch} '
                f'({self.arch_source} says so), name its architecture with --model')
        return HubError(f"{problem} ({origin}): {detail}. Give the model arguments it was trained with (train.py's "
                        f'--model-kwargs, e.g. depth=2) with --model-kwargs; {arch}.')


def read_train_output(path: Union[str, Path], model_name: Optional[str] = None, ema: bool = False,
                      model_kwargs: Optional[Dict[str, Any]] = None) -> TrainOutput:
    """Read a train.py checkpoint (train.py's ``.pth.tar``, a state dict in a ``.pth`` or ``.safetensors``, or an
    output folder: its ``model_best.pth.tar``, else ``last.pth.tar``) and the ``args.yaml`` and ``summary.csv`` beside
    it; ``model_name`` names the architecture where neither does, ``ema`` takes the EMA weights (train.py's
    ``--model-ema``), ``model_kwargs`` replace those of ``args.yaml`` (for a bare state dict, whose arguments nothing
    records)."""
    checkpoint = Path(path)
    if checkpoint.is_dir():
        found = [checkpoint / name for name in CHECKPOINT_NAMES if (checkpoint / name).is_file()]
        if not found:
            raise HubError(f'{checkpoint} has no {" or ".join(CHECKPOINT_NAMES)}: name the checkpoint to push.')
        checkpoint = found[0]
    try:
        state_dict = read_weights(checkpoint, use_ema=ema)
    except PretrainedWeightsError as e:
        raise HubError(str(e)) from e
    content = {}
    if checkpoint.suffix != '.safetensors':  # the rest of a train.py checkpoint, read as timm reads it
        with torch.serialization.safe_globals([argparse.Namespace]):
            content = torch.load(checkpoint, map_location='cpu', weights_only=True)
    if ema and content.get('state_dict_ema') is None:
        raise HubError(f'{checkpoint} has no EMA weights: train.py saves them when it trains with --model-ema.')

    args, args_file = _read_args(checkpoint.parent / 'args.yaml', content.get('args'))
    args_source = str(args_file or checkpoint) if args else None
    arch = model_name or args.get('model') or content.get('arch')
    if not arch or not timm.is_model(arch):
        named = f"names '{arch}', which timm does not know" if arch else 'does not name its architecture'
        raise HubError(f'{checkpoint} {named}: pass --model with the architecture it was trained as (a model '
                       'registered with timm, e.g. vit_hyperbf_tiny).')
    summary_file = checkpoint.parent / 'summary.csv'
    try:
        summary = read_summary(summary_file) if summary_file.exists() else []
    except ValueError as e:
        raise HubError(f'{summary_file} {e}. Repair or remove it: without it, the model card shows no training '
                       'curves.') from e
    kwargs = _model_kwargs(arch, args if model_kwargs is None else dict(args, model_kwargs=model_kwargs), state_dict)
    return TrainOutput(
        checkpoint=checkpoint, arch=arch, model_kwargs=kwargs, state_dict=state_dict, ema=ema, args=args,
        epoch=content.get('epoch') if isinstance(content.get('state_dict'), dict) else None, summary=summary,
        arch_source='--model' if model_name else args_source if args.get('model') else str(checkpoint),
        model_kwargs_source='--model-kwargs' if model_kwargs is not None else args_source)


def _read_args(path: Path, stored: Optional[argparse.Namespace]) -> Tuple[Dict[str, Any], Optional[Path]]:
    """``args.yaml`` (``path``), else (missing or empty) the arguments stored in the checkpoint, else none; and
    ``path`` if they are those of ``args.yaml``."""
    try:
        args = yaml.safe_load(path.read_bytes()) if path.exists() else None
        if args is not None and not isinstance(args, dict):
            raise yaml.YAMLError(f"a {type(args).__name__}, not train.py's arguments (names to values)")
    except yaml.YAMLError as e:  # invalid YAML, text that is no UTF-8, or no mapping
        raise HubError(f'{path} is not valid YAML ({e}). Repair or remove it: without it, the arguments stored in the '
                       'checkpoint are used.') from e
    if args is None:
        return dict(vars(stored)) if stored is not None else {}, None
    return args, path


def read_summary(path: Union[str, Path]) -> List[Dict[str, float]]:
    """train.py's ``summary.csv``: one dict of numbers per epoch (``epoch`` an int), in epoch order. A resumed run
    writes the header again and goes on from the epoch of its checkpoint, which may be older than the last row: the
    rows of that epoch and later ones written before are dropped. Raises ``ValueError`` naming the line where a row is
    not numbers (and ``OSError`` where the file cannot be read)."""
    rows: Dict[Any, Dict[str, float]] = {}
    with Path(path).open(newline='') as f:
        reader = csv.DictReader(f)
        try:
            for row in reader:
                if row.get('epoch') == 'epoch':  # the header again: the run was resumed
                    continue
                values = {k: int(v) if k == 'epoch' else float(v) for k, v in row.items() if v != ''}
                epoch = values.get('epoch', len(rows))
                rows = {e: kept for e, kept in rows.items() if e < epoch}
                rows[epoch] = values
        except (ValueError, TypeError) as e:  # a value that is no number, a row cut short or too long
            raise ValueError(f'line {reader.line_num} is not a row of numbers ({e})') from e
    return list(rows.values())


def _model_kwargs(arch: str, args: Dict[str, Any], state_dict: Dict[str, torch.Tensor]) -> Dict[str, Any]:
    """train.py's model arguments; the number of classes and input channels as the weights have them."""
    kwargs = dict(args.get('model_kwargs') or {})
    if args.get('gp'):
        kwargs['global_pool'] = args['gp']
    cfg = get_pretrained_cfg(arch)
    for key, layer, dim in (('num_classes', cfg and cfg.classifier, 0), ('in_chans', cfg and cfg.first_conv, 1)):
        weight = state_dict.get(f'{layer}.weight') if isinstance(layer, str) else None
        if weight is not None:
            kwargs[key] = weight.shape[dim]
    return kwargs
