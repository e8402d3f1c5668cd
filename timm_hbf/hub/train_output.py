"""What timm's train.py leaves in its output folder: checkpoints, ``args.yaml`` (its arguments) and ``summary.csv``
(one row of metrics per epoch), read without running any code from the files."""
import argparse
import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import safetensors.torch
import timm
import torch
import yaml
from timm.models import clean_state_dict, get_pretrained_cfg

from .errors import HubError

__all__ = ['TrainOutput', 'read_train_output']

CHECKPOINT_NAMES = ('model_best.pth.tar', 'last.pth.tar')  # what a folder stands for, in order of preference


@dataclass
class TrainOutput:
    """A checkpoint with the recipe and metrics of its training run.

    Attributes:
        checkpoint: The checkpoint file.
        arch: The model name, as ``timm.create_model`` takes it.
        model_kwargs: Keyword arguments that rebuild the model the weights belong to.
        state_dict: The weights.
        ema: Whether they are the EMA weights.
        epoch: The epoch the checkpoint was saved at, if it says.
        args: train.py's arguments (``args.yaml``, else those stored in the checkpoint), empty if unknown.
        summary: ``summary.csv``, one dict per epoch with numbers for values, empty if absent.
    """
    checkpoint: Path
    arch: str
    model_kwargs: Dict[str, Any]
    state_dict: Dict[str, torch.Tensor]
    ema: bool
    epoch: Optional[int]
    args: Dict[str, Any]
    summary: List[Dict[str, float]]

    def create_model(self) -> torch.nn.Module:
        """The model with the checkpoint's weights, in eval mode."""
        model = timm.create_model(self.arch, **self.model_kwargs)
        mismatch = _mismatch(model.state_dict(), self.state_dict)
        if mismatch:
            raise HubError(
                f'{self.checkpoint} does not fit {self.arch} built with {self.model_kwargs}: {mismatch}. '
                'Name the architecture it was trained as with --model.'
            )
        model.load_state_dict(self.state_dict)
        return model.eval()


def read_train_output(path: Union[str, Path], model_name: Optional[str] = None, ema: bool = False) -> TrainOutput:
    """Read a train.py checkpoint and the ``args.yaml`` and ``summary.csv`` beside it.

    Args:
        path: A checkpoint (train.py's ``.pth.tar``, a state dict in a ``.pth`` or ``.safetensors``) or a train.py
            output folder, which stands for its ``model_best.pth.tar`` (else ``last.pth.tar``).
        model_name: The architecture, when neither the checkpoint nor ``args.yaml`` names it.
        ema: Take the EMA weights train.py keeps with ``--model-ema``.
    """
    checkpoint = _find_checkpoint(Path(path))
    content = _load(checkpoint)
    is_train_checkpoint = isinstance(content.get('state_dict'), dict)
    key = 'state_dict_ema' if ema else 'state_dict'
    if ema and key not in content:
        raise HubError(f'{checkpoint} has no EMA weights: train.py saves them when it trains with --model-ema.')
    state_dict = clean_state_dict(content[key] if is_train_checkpoint else content)
    if not state_dict or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        raise HubError(f'{checkpoint} is neither a train.py checkpoint nor a state dict of tensors.')

    args = _read_args(checkpoint.parent / 'args.yaml', content.get('args'))
    arch = model_name or args.get('model') or content.get('arch')
    if not arch or not timm.is_model(arch):
        named = f"names '{arch}', which timm does not know" if arch else 'does not name its architecture'
        raise HubError(
            f'{checkpoint} {named}: pass --model with the architecture it was trained as '
            '(a model registered with timm, e.g. vit_hyperbf_tiny).'
        )
    return TrainOutput(
        checkpoint=checkpoint,
        arch=arch,
        model_kwargs=_model_kwargs(arch, args, state_dict),
        state_dict=state_dict,
        ema=ema,
        epoch=content.get('epoch') if is_train_checkpoint else None,
        args=args,
        summary=_read_summary(checkpoint.parent / 'summary.csv'),
    )


def _find_checkpoint(path: Path) -> Path:
    if path.is_dir():
        for name in CHECKPOINT_NAMES:
            if (path / name).is_file():
                return path / name
        raise HubError(f'{path} has no {" or ".join(CHECKPOINT_NAMES)}: name the checkpoint to push.')
    if not path.is_file():
        raise HubError(f'{path} does not exist.')
    return path


def _load(checkpoint: Path) -> Dict[str, Any]:
    """The checkpoint's content, unpickling nothing but tensors, containers and train.py's argument namespace."""
    if checkpoint.suffix == '.safetensors':
        return safetensors.torch.load_file(checkpoint)
    if not hasattr(torch.serialization, 'safe_globals'):
        raise HubError(f'Reading {checkpoint} safely needs torch 2.5 or newer; this is torch {torch.__version__}.')
    # train.py stores its arguments as an argparse.Namespace: allow that one class, which only holds attributes.
    with torch.serialization.safe_globals([argparse.Namespace]):
        try:
            return torch.load(checkpoint, map_location='cpu', weights_only=True)
        except Exception as e:  # pickle's errors, or torch's for a file that is no checkpoint at all
            raise HubError(
                f'{checkpoint} cannot be loaded as weights only ({type(e).__name__}: {e}): it holds Python objects '
                'other than tensors, or is no checkpoint. It is not unpickled any further, since that could run code.'
            ) from e


def _read_args(path: Path, stored: Optional[argparse.Namespace]) -> Dict[str, Any]:
    if path.is_file():
        return yaml.safe_load(path.read_text()) or {}
    return dict(vars(stored)) if stored is not None else {}


def _read_summary(path: Path) -> List[Dict[str, float]]:
    if not path.is_file():
        return []
    with path.open(newline='') as f:
        rows = list(csv.DictReader(f))
    return [{k: int(v) if k == 'epoch' else float(v) for k, v in row.items() if v != ''} for row in rows]


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


def _mismatch(expected: Dict[str, torch.Tensor], given: Dict[str, torch.Tensor], shown: int = 3) -> str:
    """What keeps ``given`` from loading where ``expected`` is, in a few words ('' when nothing does)."""
    def some(items: List[str]) -> str:
        return ', '.join(items[:shown]) + (', ...' if len(items) > shown else '')

    missing = [k for k in expected if k not in given]
    unexpected = [k for k in given if k not in expected]
    shapes = [f'{k} {tuple(given[k].shape)} for {tuple(v.shape)}'
              for k, v in expected.items() if k in given and given[k].shape != v.shape]
    return '; '.join(f'{len(keys)} {what} ({some(keys)})' for keys, what in (
        (missing, 'missing'), (unexpected, 'unexpected'), (shapes, 'of another shape')) if keys)
