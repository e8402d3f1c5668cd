"""What timm's train.py leaves in its output folder: checkpoints, ``args.yaml`` (its arguments) and ``summary.csv``
(metrics per epoch), read weights only, as timm reads them."""
import argparse
import csv
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import timm
import torch
import yaml
from timm.models import get_pretrained_cfg

from ..models import PretrainedWeightsError, read_weights, state_dict_mismatch

__all__ = ['HubError', 'TrainOutput', 'read_summary', 'read_train_output']


class HubError(RuntimeError):
    """What ``timm-hbf push`` cannot read, write or push; the message says what to do."""


@dataclass
class TrainOutput:
    """A checkpoint (``arch``, the ``model_kwargs`` that rebuild it, its weights, EMA or not, ``epoch``) with
    train.py's ``args`` and ``summary`` (one dict of numbers per epoch), empty where unknown."""
    checkpoint: Path
    arch: str
    model_kwargs: Dict[str, Any]
    state_dict: Dict[str, torch.Tensor]
    ema: bool = False
    epoch: Optional[int] = None
    args: Dict[str, Any] = field(default_factory=dict)
    summary: List[Dict[str, float]] = field(default_factory=list)

    def create_model(self) -> torch.nn.Module:
        """The model with the checkpoint's weights, in eval mode."""
        try:
            model = timm.create_model(self.arch, **self.model_kwargs)
            problem = state_dict_mismatch(model.state_dict(), self.state_dict)
        except (TypeError, ValueError) as e:  # an argument the model does not take, or a value it refuses
            problem = str(e)
        if problem:
            raise HubError(f'{self.checkpoint} does not fit {self.arch} built with {self.model_kwargs}: {problem}. '
                           "Give the model arguments it was trained with (train.py's) with --model-kwargs, and its "
                           'architecture with --model.')
        model.load_state_dict(self.state_dict)
        return model.eval()


def read_train_output(path: Union[str, Path], model_name: Optional[str] = None, ema: bool = False,
                      model_kwargs: Optional[Dict[str, Any]] = None) -> TrainOutput:
    """Read a checkpoint (train.py's ``.pth.tar``, a state dict in a ``.pth`` or ``.safetensors`` file, or an output
    folder: its ``model_best.pth.tar``, else ``last.pth.tar``) with the ``args.yaml`` and ``summary.csv`` beside it.
    ``model_name`` and ``model_kwargs`` replace the architecture and model arguments these record; ``ema`` takes the
    EMA weights (train.py's ``--model-ema``)."""
    checkpoint = Path(path)
    if checkpoint.is_dir():
        found = [checkpoint / n for n in ('model_best.pth.tar', 'last.pth.tar') if (checkpoint / n).is_file()]
        if not found:
            raise HubError(f'{checkpoint} has no model_best.pth.tar or last.pth.tar: name the checkpoint to push.')
        checkpoint = found[0]
    try:
        state_dict = read_weights(checkpoint, use_ema=ema)
    except PretrainedWeightsError as e:
        raise HubError(str(e)) from e
    content = {}
    if checkpoint.suffix != '.safetensors':  # the rest of a train.py checkpoint
        with torch.serialization.safe_globals([argparse.Namespace]):
            content = torch.load(checkpoint, map_location='cpu', weights_only=True)
    if ema and content.get('state_dict_ema') is None:
        raise HubError(f'{checkpoint} has no EMA weights: train.py saves them when it trains with --model-ema.')

    args_file, summary_file = checkpoint.parent / 'args.yaml', checkpoint.parent / 'summary.csv'
    try:
        args = yaml.safe_load(args_file.read_bytes()) if args_file.exists() else None
        if not isinstance(args, (dict, type(None))):
            raise yaml.YAMLError(f'a {type(args).__name__}, not arguments by name')
        summary = read_summary(summary_file) if summary_file.exists() else []
    except (yaml.YAMLError, ValueError) as e:
        bad = args_file if isinstance(e, yaml.YAMLError) else summary_file
        raise HubError(f'{bad} cannot be read ({" ".join(str(e).split())}): repair or remove it.') from e
    if args is None:  # those train.py stores in its checkpoints
        args = dict(vars(content['args'])) if content.get('args') is not None else {}
    arch = model_name or args.get('model') or content.get('arch')
    if not arch or not timm.is_model(arch):
        raise HubError(f'{checkpoint}: no architecture timm knows ({arch!r}): name the one it was trained as with '
                       '--model, e.g. --model vit_hyperbf_tiny.')

    kwargs = dict(args.get('model_kwargs') or {} if model_kwargs is None else model_kwargs)
    if args.get('gp'):  # train.py's --gp
        kwargs['global_pool'] = args['gp']
    cfg = get_pretrained_cfg(arch)  # the classes and input channels as the weights have them
    for key, layer, dim in (('num_classes', cfg and cfg.classifier, 0), ('in_chans', cfg and cfg.first_conv, 1)):
        if isinstance(layer, str) and f'{layer}.weight' in state_dict:
            kwargs[key] = state_dict[f'{layer}.weight'].shape[dim]
    return TrainOutput(checkpoint, arch, kwargs, state_dict, ema=ema, args=args, summary=summary,
                       epoch=content.get('epoch') if 'state_dict' in content else None)


def read_summary(path: Union[str, Path]) -> List[Dict[str, float]]:
    """train.py's ``summary.csv``: one dict of numbers per epoch (``epoch`` an int), in epoch order. A resumed run
    writes the header again and goes on from its checkpoint's epoch, which drops the rows of that epoch and later ones
    written before. Raises ``ValueError`` naming the line of a row that is not numbers."""
    rows: Dict[int, Dict[str, float]] = {}
    with Path(path).open(newline='') as f:
        reader = csv.DictReader(f)
        try:
            for row in reader:
                if row.get('epoch') != 'epoch':  # else the header again: the run was resumed
                    values = {k: int(v) if k == 'epoch' else float(v) for k, v in row.items() if v != ''}
                    epoch = values.get('epoch', len(rows))
                    rows = {e: kept for e, kept in rows.items() if e < epoch}
                    rows[epoch] = values
        except (ValueError, TypeError) as e:  # a value that is no number, a row cut short or too long
            raise ValueError(f'line {reader.line_num} is not a row of numbers: {e}') from e
    return list(rows.values())
