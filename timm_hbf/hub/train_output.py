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
    the recipe and metrics of its training run: train.py's ``args`` (``args.yaml``, else those stored in the
    checkpoint) and ``summary`` (``summary.csv``, one dict of numbers per epoch), each empty if unknown. For messages:
    where ``arch`` comes from (``'--model'`` or the file that names it), and the model arguments besides the classes
    and input channels of the weights (``'--model-kwargs'``, the file that records them, or None)."""
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
            raise HubError(f'{self.arch} cannot be built with {self.model_kwargs} ({self._origin()}): {e}. '
                           f'{self._fix()}.') from e
        mismatch = state_dict_mismatch(model.state_dict(), self.state_dict)
        if mismatch:
            raise HubError(f'{self.checkpoint} does not fit {self.arch} built with {self.model_kwargs} '
                           f'({self._origin()}): {mismatch}. {self._fix()}.')
        model.load_state_dict(self.state_dict)
        return model.eval()

    def _origin(self) -> str:
        if self.model_kwargs_source in (None, '--model-kwargs'):
            return ('the model arguments given with --model-kwargs' if self.model_kwargs_source else
                    'no model arguments: neither the checkpoint nor an args.yaml beside it records them')
        return f'the model arguments of {self.model_kwargs_source}'

    def _fix(self) -> str:
        trained = "the model arguments it was trained with (train.py's --model-kwargs, e.g. depth=2)"
        if self.model_kwargs_source == '--model-kwargs':
            fix = "Fix --model-kwargs: they must be the model arguments it was trained with (train.py's)"
        elif str(self.model_kwargs_source).endswith('args.yaml'):
            fix = f'Fix model_kwargs in {self.model_kwargs_source}, or give {trained} with --model-kwargs'
        else:  # none, or those stored in the checkpoint
            fix = f'Give {trained} with --model-kwargs'
        if self.arch_source == '--model':
            return f'{fix}; check --model too'
        return (f'{fix}; if it was not trained as {self.arch} ({self.arch_source} says so), name its architecture '
                'with --model')


def read_train_output(path: Union[str, Path], model_name: Optional[str] = None, ema: bool = False,
                      model_kwargs: Optional[Dict[str, Any]] = None) -> TrainOutput:
    """Read a train.py checkpoint (train.py's ``.pth.tar``, a state dict in a ``.pth`` or ``.safetensors``, or an
    output folder: its ``model_best.pth.tar``, else ``last.pth.tar``) and the ``args.yaml`` and ``summary.csv`` beside
    it; ``model_name`` names the architecture where neither does, ``ema`` takes the EMA weights (train.py's
    ``--model-ema``), ``model_kwargs`` replace those of ``args.yaml`` (for a bare state dict, whose arguments nothing
    records)."""
    checkpoint = _find_checkpoint(Path(path))
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
    is_train_checkpoint = isinstance(content.get('state_dict'), dict)

    args, args_file = _read_args(checkpoint.parent / 'args.yaml', content.get('args'))
    args_source = str(args_file or checkpoint) if args else None
    arch = model_name or args.get('model') or content.get('arch')
    if not arch or not timm.is_model(arch):
        named = f"names '{arch}', which timm does not know" if arch else 'does not name its architecture'
        raise HubError(f'{checkpoint} {named}: pass --model with the architecture it was trained as (a model '
                       'registered with timm, e.g. vit_hyperbf_tiny).')
    return TrainOutput(
        checkpoint=checkpoint,
        arch=arch,
        model_kwargs=_model_kwargs(arch, args if model_kwargs is None else dict(args, model_kwargs=model_kwargs),
                                   state_dict),
        state_dict=state_dict,
        ema=ema,
        epoch=content.get('epoch') if is_train_checkpoint else None,
        args=args,
        summary=_read_run_summary(checkpoint.parent / 'summary.csv'),
        arch_source='--model' if model_name else args_source if args.get('model') else str(checkpoint),
        model_kwargs_source='--model-kwargs' if model_kwargs is not None else args_source,
    )


def _find_checkpoint(path: Path) -> Path:
    """The checkpoint a train.py output folder stands for; any other path as it is (reading it names its faults)."""
    if not path.is_dir():
        return path
    for name in CHECKPOINT_NAMES:
        if (path / name).is_file():
            return path / name
    raise HubError(f'{path} has no {" or ".join(CHECKPOINT_NAMES)}: name the checkpoint to push.')


def _unusable(path: Path, problem: str, without: str) -> HubError:
    return HubError(f'{path} {problem}. Repair or remove it: without it, {without}.')


def _read_args(path: Path, stored: Optional[argparse.Namespace]) -> Tuple[Dict[str, Any], Optional[Path]]:
    """``args.yaml`` (``path``), else (missing or empty) the arguments stored in the checkpoint, else none; and
    ``path`` if they are those of ``args.yaml``."""
    without = 'the arguments stored in the checkpoint are used'
    try:
        args = yaml.safe_load(path.read_text()) if path.exists() else None
    except (OSError, UnicodeDecodeError) as e:
        raise _unusable(path, f'cannot be read ({e})', without) from e
    except yaml.YAMLError as e:
        raise _unusable(path, f'is not valid YAML ({e})', without) from e
    if args is None:
        return dict(vars(stored)) if stored is not None else {}, None
    if not isinstance(args, dict):
        raise _unusable(path, f"holds a {type(args).__name__}, not train.py's arguments (names to values)", without)
    return args, path


def read_summary(path: Union[str, Path]) -> List[Dict[str, float]]:
    """train.py's ``summary.csv``: one dict of numbers per epoch (``epoch`` an int). A resumed run writes the header
    again and goes on from the epoch of its checkpoint, which may be older than the last row: the rows of that epoch
    and later ones before the header are dropped, and an epoch keeps its last row. Raises ``ValueError`` naming the
    line where a row is not numbers (and ``OSError`` where the file cannot be read)."""
    rows: List[Dict[str, float]] = []
    resumed = False
    with Path(path).open(newline='') as f:
        reader = csv.DictReader(f)
        try:
            for row in reader:
                if row.get('epoch') == 'epoch':
                    resumed = True
                    continue
                values = {k: int(v) if k == 'epoch' else float(v) for k, v in row.items() if v != ''}
                if resumed and 'epoch' in values:
                    rows = [kept for kept in rows if kept.get('epoch', -1) < values['epoch']]
                resumed = False
                rows.append(values)
        except (ValueError, TypeError) as e:  # a value that is no number, a row cut short or too long
            raise ValueError(f'line {reader.line_num} is not a row of numbers ({e})') from e
    return list({row.get('epoch', i): row for i, row in enumerate(rows)}.values())


def _read_run_summary(path: Path) -> List[Dict[str, float]]:
    """:func:`read_summary`, none if the file is missing, and its faults as :class:`HubError`."""
    without = 'the model card shows no training curves'
    if not path.exists():
        return []
    try:
        return read_summary(path)
    except (OSError, UnicodeDecodeError) as e:
        raise _unusable(path, f'cannot be read ({e})', without) from e
    except ValueError as e:
        raise _unusable(path, str(e), without) from e


def _model_kwargs(arch: str, args: Dict[str, Any], state_dict: Dict[str, torch.Tensor]) -> Dict[str, Any]:
    """train.py's model arguments; the number of classes and input channels as the weights have them."""
    kwargs = dict(args.get('model_kwargs') or {})
    if args.get('gp'):
        kwargs['global_pool'] = args['gp']
    cfg = get_pretrained_cfg(arch)
    layers = (cfg.classifier, cfg.first_conv) if cfg is not None else (None, None)
    for key, layer, dim in zip(('num_classes', 'in_chans'), layers, (0, 1)):
        weight = state_dict.get(f'{layer}.weight') if isinstance(layer, str) else None
        if weight is not None:
            kwargs[key] = weight.shape[dim]
    return kwargs
