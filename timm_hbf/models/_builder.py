"""Build models with timm's ``build_model_with_cfg``, their pretrained weights checked before they load, and the
pretrained cfgs both families share.

timm takes a weights file as its name says and passes every failure on as it comes: a tag without weights, a missing,
empty, truncated or mislabelled file, or the checkpoint of another model each end in an error of the reader or of
``load_state_dict`` that does not say which file or what to do. :func:`build_model` reads the file itself, weights
only, and raises :class:`PretrainedWeightsError` naming the tag or file, what is wrong and the fix.
"""
import argparse
import inspect
import json
import pickle
import re
import threading
import zipfile
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Type, TypeVar, Union

import safetensors
import safetensors.torch
import torch
from timm.data import IMAGENET_INCEPTION_MEAN, IMAGENET_INCEPTION_STD
from timm.models import (
    PretrainedCfg,
    adapt_input_conv,
    build_model_with_cfg,
    clean_state_dict,
    get_arch_pretrained_cfgs,
    resolve_pretrained_cfg,
)
from torch import nn

__all__ = [
    'CIFAR10_LABELS', 'CIFAR10_MEAN', 'CIFAR10_STD', 'PretrainedWeightsError', 'WeightsFileError', 'build_model',
    'build_vit', 'cifar10_weights', 'read_checkpoint', 'state_dict_mismatch', 'vit_cfg', 'weights_of',
]

ModelT = TypeVar('ModelT', bound=nn.Module)
# timm adapts input weights of any number of channels (1.0.31 and newer), or only those of 3 channels
ADAPTS_ANY_CHANNELS = 'base_chans' in inspect.signature(adapt_input_conv).parameters

WEIGHTS_KEYS = ('state_dict_ema', 'model_ema', 'state_dict', 'model')  # where timm looks in a checkpoint, EMA first
OWN_WEIGHTS = ("pretrained_cfg_overlay=dict(file=PATH) loads your own (a checkpoint of train.py, or a state dict in "
               "a .pth or .safetensors file; in timm's train.py --pretrained-path PATH, in validate.py --checkpoint "
               "PATH); 'hf-hub:ORG/NAME' as the model name loads a Hugging Face Hub repo.")
AGAIN = 'Save or copy the weights again.'
CUT_SHORT = f'It was cut short while being written or copied. {AGAIN}'
# CIFAR-10 training-set channel statistics: the normalisation in the pretrained_cfg of every 32 x 32 model
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
# CIFAR-10's class names in the order of its labels (and of its class folders, sorted)
CIFAR10_LABELS = ('airplane', 'automobile', 'bird', 'cat', 'deer', 'dog', 'frog', 'horse', 'ship', 'truck')


class PretrainedWeightsError(RuntimeError):
    """Pretrained weights cannot be loaded; the message names the tag or file, what is wrong and the fix."""


class WeightsFileError(PretrainedWeightsError):
    """A weights file cannot be read: ``{path} {problem}. {fix}``."""

    def __init__(self, path: Union[str, Path], problem: str, fix: str) -> None:
        super().__init__(f'{path} {problem}. {fix}')
        self.path, self.problem = path, problem


def build_model(
        model_cls: Type[ModelT],
        variant: str,
        pretrained: bool,
        pretrained_cfg: Optional[Union[str, Dict[str, Any], PretrainedCfg]] = None,
        pretrained_cfg_overlay: Optional[Dict[str, Any]] = None,
        pretrained_filter_fn: Optional[Callable] = None,
        pretrained_strict: bool = True,
        **kwargs,
) -> ModelT:
    """timm's ``build_model_with_cfg`` (same arguments), with the tag and the pretrained weights checked first.

    A tag that does not exist, or ``pretrained=True`` where the tag has no weights, raises naming the tags there are.
    A local weights file (the cfg's ``file``) is read here, weights only, and any fault of it raises naming the file;
    its classifier gives the number of classes of the weights and its stem their input channels, so a checkpoint of
    another number of classes or channels loads as it is, and a ``num_classes`` or ``in_chans`` that differs resets
    the head or adapts the stem as for timm's own weights. Weights of any source that do not fit the model raise
    naming what differs. All raise :class:`PretrainedWeightsError`. The tag's class names stay only on a model they
    describe.
    """
    if isinstance(pretrained_cfg, str):
        _check_tag(variant, pretrained_cfg)
    overlay = dict(pretrained_cfg_overlay or {})
    own_file = 'file' in overlay and 'label_names' not in overlay
    if not pretrained:
        model = build_model_with_cfg(
            model_cls, variant, False, pretrained_cfg=pretrained_cfg, pretrained_cfg_overlay=overlay,
            pretrained_filter_fn=pretrained_filter_fn, pretrained_strict=pretrained_strict, **kwargs)
        _clean_pretrained_cfgs(model, own_file)
        return model

    cfg = resolve_pretrained_cfg(variant, pretrained_cfg, dict(overlay))
    location, trained_as = _weights_location(cfg, variant), None
    if cfg.file and cfg.source not in ('hf-hub', 'local-dir') and cfg.state_dict is None and not cfg.custom_load:
        try:
            checkpoint = read_checkpoint(cfg.file)
            state_dict = weights_of(checkpoint, cfg.file)
        except WeightsFileError as e:
            if 'file' in overlay:
                raise
            raise PretrainedWeightsError(
                f'The weights of {variant}.{cfg.tag} ship with timm-hbf as {e.path}, which {e.problem}: the '
                'installation is incomplete. Reinstall timm-hbf (pip install --force-reinstall --no-deps timm-hbf).'
            ) from e
        trained_as = checkpoint.get('arch') if isinstance(checkpoint.get('arch'), str) else None
        overlay['state_dict'] = state_dict  # timm loads it from memory: the file is read once
        head = state_dict.get(f'{cfg.classifier}.weight') if isinstance(cfg.classifier, str) else None
        if head is not None:
            overlay.setdefault('num_classes', head.shape[0])
        stem = state_dict.get(f'{cfg.first_conv}.weight') if isinstance(cfg.first_conv, str) else None
        if stem is not None and stem.ndim == 4 and cfg.input_size is not None:  # the weights' input channels
            overlay.setdefault('input_size', (stem.shape[1], *cfg.input_size[1:]))

    def filter_and_check(state_dict: Dict[str, Any], model: nn.Module) -> Dict[str, Any]:
        """The model's own filter, then the check that the weights fit, apart from what timm adapts: the input
        layer (to ``in_chans``) and, where the number of classes differs, the classifier (left out)."""
        _check_prefix_tokens(state_dict, model, location, variant)
        if pretrained_filter_fn is not None:
            state_dict = pretrained_filter_fn(state_dict, model)
        _check_input_channels(state_dict, model, cfg.first_conv, location, variant)
        head_kept = not kwargs.get('features_only') and model.num_classes == overlay.get('num_classes', cfg.num_classes)
        expected = model.state_dict()
        mismatch = state_dict_mismatch(
            expected, state_dict, strict=pretrained_strict,
            ignored=() if head_kept else _names(cfg.classifier), any_shape=_names(cfg.first_conv))
        if mismatch:
            if 'norm.weight' in state_dict and 'norm.weight' not in expected and 'fc_norm.weight' in expected:
                fix = (" The weights norm the tokens before the pooling (norm), the model after it (fc_norm, "
                       "timm's ViT default with global_pool 'avg', 'max' or 'avgmax'): pass fc_norm=False to pool "
                       "the tokens as the weights were trained to.")
            else:
                saved_from = f' They were saved from a {trained_as}.' if trained_as not in (None, variant) else ''
                fix = (f'{saved_from} Create the model the weights were trained as, with the same model arguments '
                       '(those of train.py --model and --model-kwargs).')
            raise PretrainedWeightsError(f'{location} does not fit {variant} as built: {mismatch}.{fix}')
        return state_dict

    model = build_model_with_cfg(
        model_cls, variant, True, pretrained_cfg=pretrained_cfg, pretrained_cfg_overlay=overlay,
        pretrained_filter_fn=filter_and_check, pretrained_strict=pretrained_strict, **kwargs)
    _clean_pretrained_cfgs(model, own_file)
    return model


def _check_prefix_tokens(state_dict: Dict[str, Any], model: nn.Module, location: str, variant: str) -> None:
    """Weights with another class token or other register tokens than the model raise naming the model arguments
    that fit them (the filter would otherwise resample their position embedding with the model's count, and fail)."""
    if not isinstance(state_dict.get('pos_embed'), torch.Tensor) or not hasattr(model, 'num_prefix_tokens'):
        return
    registers = state_dict.get('reg_token')
    given = ('cls_token' in state_dict, registers.shape[1] if isinstance(registers, torch.Tensor) else 0)
    built = (getattr(model, 'cls_token', None) is not None, getattr(model, 'num_reg_tokens', 0))
    if given != built:
        def tokens(class_token: bool, reg_tokens: int) -> str:
            return f"{'a' if class_token else 'no'} class token and {reg_tokens} register tokens"
        pool = '' if given[0] else " (and a global_pool other than 'token')"
        raise PretrainedWeightsError(
            f'{location} does not fit {variant} as built: the weights have {tokens(*given)}, the model '
            f'{tokens(*built)}. Create the model with class_token={given[0]} and reg_tokens={given[1]}{pool}, as the '
            'weights were trained.')


def _check_input_channels(
        state_dict: Dict[str, Any], model: nn.Module, first_conv: Union[None, str, Iterable[str]], location: str,
        variant: str) -> None:
    """Before 1.0.31, timm loads input weights of 3 channels into a model of any, and of 1 channel into a model of 1;
    it re-initialises or fails to load all others, which raise here naming the fixes."""
    if ADAPTS_ANY_CHANNELS:
        return
    for name in _layers(first_conv):
        weight, conv = state_dict.get(f'{name}.weight'), model.get_submodule(name)
        if not isinstance(weight, torch.Tensor) or weight.ndim != 4 or not isinstance(conv, nn.Conv2d):
            continue
        weights_chans, model_chans = weight.shape[1], conv.in_channels
        if weights_chans == 3 or weights_chans == model_chans == 1:
            continue
        fix = 'Create the model with in_chans=1, or upgrade' if weights_chans == 1 else 'Upgrade'
        raise PretrainedWeightsError(
            f'{location} has {weights_chans}-channel input weights ({name}) and {variant} is built for '
            f'{model_chans}: timm before 1.0.31 adapts only 3-channel input weights (and loads 1-channel ones into a '
            f'1-channel model), and would re-initialise or refuse these. {fix} timm to 1.0.31 or newer, which adapts '
            'any number.')


def _clean_pretrained_cfgs(model: nn.Module, own_file: bool) -> None:
    """The pretrained cfgs of the model and, with ``features_only``, of the model it wraps: no copy of the weights
    kept, and no class names (``label_names``, ``label_descriptions``) where they do not describe the weights: the
    tag's, on a model of another number of classes or given a weights file of its own without names (timm's
    inference.py would name another head's classes with them)."""
    for module in model.modules():
        cfg = getattr(module, 'pretrained_cfg', None)
        if not isinstance(cfg, dict):
            continue
        cfg.pop('state_dict', None)
        names = cfg.get('label_names')
        if names is not None and (own_file or getattr(module, 'num_classes', len(names)) != len(names)):
            cfg['label_names'] = cfg['label_descriptions'] = None


def build_vit(model_cls: Type[ModelT], variant: str, pretrained: bool, filter_fn: Callable, **kwargs) -> ModelT:
    """:func:`build_model` for a ViT-shaped family: ``features_only`` takes every block's output (getter features,
    ``out_indices`` the last 3 by default), as for timm's ViT."""
    feature_cfg = dict(out_indices=kwargs.pop('out_indices', 3), feature_cls='getter')
    return build_model(model_cls, variant, pretrained, pretrained_filter_fn=filter_fn, feature_cfg=feature_cfg,
                       **kwargs)


def vit_cfg(cifar10: bool = False, **kwargs) -> Dict[str, Any]:
    """A pretrained cfg as timm's ViTs have it (ImageNet at 224 x 224), or at CIFAR-10's 32 x 32 and statistics."""
    data = dict(num_classes=10, input_size=(3, 32, 32), crop_pct=1.0, mean=CIFAR10_MEAN, std=CIFAR10_STD) if cifar10 \
        else dict(num_classes=1000, input_size=(3, 224, 224), crop_pct=0.9, mean=IMAGENET_INCEPTION_MEAN,
                  std=IMAGENET_INCEPTION_STD)
    return dict(url='', pool_size=None, interpolation='bicubic', fixed_input_size=True, first_conv='patch_embed.proj',
                classifier='head', license='apache-2.0', **data, **kwargs)


def cifar10_weights(name: str) -> Dict[str, Any]:
    """The cfg entries of the CIFAR-10 weights ``MODEL.TAG`` that ship in the wheel: the file (bf16 but for the kernel
    widths, as ``timm-hbf push --dtype bfloat16`` writes them; timm loads them into float32 models) and the class
    names in classifier order (``label_names``, which timm's inference.py reads)."""
    return dict(file=str(Path(__file__).resolve().parents[1] / 'weights' / f'{name}.safetensors'),
                label_names=CIFAR10_LABELS)


def _check_tag(variant: str, tag: str) -> None:
    cfgs = get_arch_pretrained_cfgs(variant)
    if f'{variant}.{tag}' not in cfgs:
        raise PretrainedWeightsError(f"{variant} has no pretrained tag '{tag}'. {_tags(variant, cfgs)}")


def _tags(variant: str, cfgs: Dict[str, PretrainedCfg]) -> str:
    """The tags of ``variant``, those with weights first, and how to load other weights."""
    with_weights = [name for name, cfg in cfgs.items() if cfg.has_weights]
    without = [name for name in cfgs if name not in with_weights]
    if not with_weights:
        return f'No tag of {variant} has weights yet (its tags: {", ".join(without) or "none"}). {OWN_WEIGHTS}'
    without = f'; without: {", ".join(without)}' if without else ''
    return f'Tags with weights: {", ".join(with_weights)}{without}. {OWN_WEIGHTS}'


def _weights_location(cfg: PretrainedCfg, variant: str) -> str:
    """Where ``cfg`` has its weights, for messages; raises if it has none."""
    if cfg.state_dict is not None:
        return 'the state_dict of pretrained_cfg'
    location = cfg.file or (cfg.hf_hub_id and f'hf-hub:{cfg.hf_hub_id}') or cfg.url
    if not location:
        name = f'{variant}.{cfg.tag}' if cfg.tag else variant
        raise PretrainedWeightsError(
            f'{name} has no pretrained weights. {_tags(variant, get_arch_pretrained_cfgs(variant))} '
            "Or create it with pretrained=False (in timm's scripts, without --pretrained).")
    return location


def _layers(layers: Union[None, str, Iterable[str]]) -> Iterable[str]:
    """The layer names of a cfg's ``first_conv`` or ``classifier`` (one layer, several, or none)."""
    return (layers,) if isinstance(layers, str) else layers or ()


def _names(layers: Union[None, str, Iterable[str]]) -> Set[str]:
    """The weight and bias names of a cfg's ``first_conv`` or ``classifier``."""
    return {f'{layer}.{param}' for layer in _layers(layers) for param in ('weight', 'bias')}


def state_dict_mismatch(
        expected: Dict[str, torch.Tensor],
        given: Dict[str, torch.Tensor],
        strict: bool = True,
        ignored: Iterable[str] = (),
        any_shape: Iterable[str] = (),
        shown: int = 3,
) -> str:
    """What keeps ``given`` from loading where ``expected`` is, in a few words ('' when nothing does).

    Args:
        expected: The model's state dict.
        given: The weights.
        strict: Count the model's entries that the weights lack.
        ignored: Names left out on both sides (a head that is replaced).
        any_shape: Names whose shape may differ (an input layer that timm adapts).
        shown: How many names of each kind to show.
    """
    def some(names: List[str]) -> str:
        return ', '.join(names[:shown]) + (', ...' if len(names) > shown else '')

    ignored, any_shape = set(ignored), set(any_shape)
    missing = [k for k in expected if k not in given and k not in ignored] if strict else []
    unexpected = [k for k in given if k not in expected and k not in ignored]
    shapes = [f'{k} {tuple(given[k].shape)} for {tuple(v.shape)}' for k, v in expected.items()
              if k in given and k not in ignored | any_shape and given[k].shape != v.shape]
    return '; '.join(f'{len(names)} {what} ({some(names)})' for names, what in (
        (missing, 'missing'), (unexpected, 'unexpected'), (shapes, 'of another shape')) if names)


def read_checkpoint(path: Union[str, Path]) -> Any:
    """The content of a weights file: a ``.safetensors`` file, or any other as a ``torch.save`` checkpoint unpickled
    weights only (tensors, containers, and the argument namespace of train.py).

    Raises :class:`WeightsFileError` where it is missing, a folder, empty, truncated, damaged, of another format than
    its name says, or holds Python objects besides tensors.
    """
    path = Path(path)
    if not path.exists():
        raise WeightsFileError(path, 'does not exist', 'Check the path.')
    if path.is_dir():
        raise WeightsFileError(path, 'is a folder, not a weights file', 'Name the weights file in it.')
    size = path.stat().st_size
    with path.open('rb') as f:
        head = f.read(32)
    if size < 9:  # no weights file is this short: safetensors alone starts with 8 bytes of header size
        raise WeightsFileError(path, 'is empty' if size == 0 else f'holds only {size} bytes, too few for weights',
                               CUT_SHORT)
    written_as = _format(head)
    if written_as is None and head.startswith(b'version https://git-lfs'):
        raise WeightsFileError(path, 'is a Git LFS pointer, not the weights', 'Fetch the file with `git lfs pull`.')
    if written_as is None:
        raise WeightsFileError(
            path, f'is neither a safetensors file nor a torch.save checkpoint (it starts with {head[:16]!r})',
            'Name a checkpoint of train.py, or weights saved by torch.save or safetensors.torch.save_file.')
    named_as = 'safetensors' if path.suffix == '.safetensors' else 'torch.save'
    if written_as != named_as:
        raise WeightsFileError(
            path, f'is a {written_as} file, but its name says {named_as}',
            f'Rename it to end in {".safetensors" if written_as == "safetensors" else ".pth"}.')
    return _read_safetensors(path, head, size) if written_as == 'safetensors' else _read_torch(path, head)


def _format(head: bytes) -> Optional[str]:
    """'safetensors' or 'torch.save' from the first bytes of a file, None for anything else."""
    if head[8:9] == b'{' and int.from_bytes(head[:8], 'little') < 1 << 32:  # safetensors: JSON header size, header
        return 'safetensors'
    if head.startswith(b'PK\x03\x04') or head.startswith(b'\x80'):  # torch.save: a zip archive, or a pickle (legacy)
        return 'torch.save'
    return None


def _truncated(path: Path, detail: str) -> WeightsFileError:
    return WeightsFileError(path, f'is truncated ({detail})', CUT_SHORT)


def _damaged(path: Path, problem: str, err: Exception) -> WeightsFileError:
    return WeightsFileError(path, f'is damaged: {problem} ({type(err).__name__}: {err})', AGAIN)


def _read_safetensors(path: Path, head: bytes, size: int) -> Dict[str, torch.Tensor]:
    header_end = 8 + int.from_bytes(head[:8], 'little')
    if header_end > size:
        raise _truncated(path, f'its header alone takes {header_end} bytes, the file has {size}')
    with path.open('rb') as f:
        f.seek(8)
        try:
            header = json.loads(f.read(header_end - 8))
            data_end = header_end + max(
                (entry['data_offsets'][1] for name, entry in header.items() if name != '__metadata__'), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            raise _damaged(path, 'its safetensors header cannot be parsed', e) from e
    if data_end > size:
        raise _truncated(path, f'its header describes {data_end} bytes, the file has {size}')
    try:
        return safetensors.torch.load_file(path)
    except safetensors.SafetensorError as e:
        raise _damaged(path, 'safetensors cannot read it', e) from e


_SAFE_GLOBALS_LOCK = threading.Lock()


def _read_torch(path: Path, head: bytes) -> Any:
    if head.startswith(b'PK') and not zipfile.is_zipfile(path):  # the archive's directory, at its end, is gone
        raise _truncated(path, 'its zip archive has no end')
    # train.py stores its arguments as an argparse.Namespace: allow that one class, which only holds attributes. The
    # allowlist is global to the process, so threads reading checkpoints at once take turns (one's exit ends another's)
    with _SAFE_GLOBALS_LOCK, torch.serialization.safe_globals([argparse.Namespace]):
        try:
            return torch.load(path, map_location='cpu', weights_only=True)
        except pickle.UnpicklingError as e:
            refused = _REFUSED_GLOBAL.search(str(e))
            if refused is None:  # no class or function but an instruction the unpickler does not know: random bytes
                raise _damaged(path, 'torch.load cannot read it', _unpickler_error(e)) from e
            raise WeightsFileError(
                path, f'holds Python objects besides tensors ({refused[1]} among them)',
                'It is not unpickled any further, since that could run code: save the state dict alone '
                '(model.state_dict()) with torch.save or safetensors.torch.save_file.') from e
        except Exception as e:  # the reader's errors of a damaged archive or pickle (legacy format: truncation too)
            raise _damaged(path, 'torch.load cannot read it', e) from e


# What torch's weights-only unpickler says of a class or function it refuses: one not allowed, or of a blocked module
_REFUSED_GLOBAL = re.compile(r'GLOBAL (\S+) (?:was not an allowed global|whose module \S+ is blocked)')


def _unpickler_error(err: pickle.UnpicklingError) -> pickle.UnpicklingError:
    """The error of torch's weights-only unpickler that ``torch.load`` raised ``err`` for, without the advice
    ``torch.load`` wraps it in (among it, to load the file with ``weights_only=False``, which could run its code)."""
    inner = err.__context__  # torch.load raises its own error `from None` in the handler of the unpickler's
    if isinstance(inner, pickle.UnpicklingError) and 'weights_only' not in str(inner):
        return inner
    last = str(err).split('Check the documentation')[0].strip().split('\n\n')[-1]  # torch's layout: advice, error
    return pickle.UnpicklingError(last if 'weights_only' not in last else 'not a pickle of tensors')


def weights_of(checkpoint: Any, path: Union[str, Path], keys: Iterable[str] = WEIGHTS_KEYS) -> Dict[str, torch.Tensor]:
    """The state dict in ``checkpoint`` (what :func:`read_checkpoint` read from ``path``): the entry of the first of
    ``keys`` it has (a checkpoint of train.py), else the checkpoint itself; ``module.`` prefixes removed."""
    weights = checkpoint
    if isinstance(checkpoint, dict):
        weights = next((checkpoint[k] for k in keys if isinstance(checkpoint.get(k), dict)), checkpoint)
    if not isinstance(weights, dict) or not weights or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise WeightsFileError(
            path, 'holds no weights: it is neither a checkpoint of train.py nor a state dict (names to tensors)',
            'Name the file that train.py or torch.save(model.state_dict(), PATH) wrote.')
    return clean_state_dict(weights)
