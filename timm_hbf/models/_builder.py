"""Build models with timm's ``build_model_with_cfg``, and the pretrained cfgs both families share.

timm reads and loads the weights. Where its error would not say which tag or file failed or what to do, or where it
would go on with wrong weights, :func:`build_vit` raises :class:`PretrainedWeightsError` naming the tag or file, what
is wrong and the fix: a tag that does not exist or has no weights, a weights file that is missing or cannot be read,
weights that do not fit the model as built.
"""
import inspect
import os
import re
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Optional, Set, Type, TypeVar, Union

import torch
from timm.data import IMAGENET_INCEPTION_MEAN, IMAGENET_INCEPTION_STD
from timm.models import (
    PretrainedCfg,
    adapt_input_conv,
    build_model_with_cfg,
    get_arch_pretrained_cfgs,
    load_state_dict,
    resolve_pretrained_cfg,
)
from torch import nn

__all__ = ['CIFAR10_LABELS', 'CIFAR10_MEAN', 'CIFAR10_STD', 'PretrainedWeightsError', 'build_vit', 'cifar10_weights',
           'read_weights', 'state_dict_mismatch', 'vit_cfg']

ModelT = TypeVar('ModelT', bound=nn.Module)
# timm adapts input weights of any number of channels from 1.0.31 on; before, only those of 3 (and any into 1)
ADAPTS_ANY_CHANNELS = 'base_chans' in inspect.signature(adapt_input_conv).parameters
OWN_WEIGHTS = ("pretrained_cfg_overlay=dict(file=PATH) loads your own (a checkpoint of train.py, or a state dict in "
               "a .pth or .safetensors file; in timm's train.py --pretrained-path PATH, in validate.py --checkpoint "
               "PATH); 'hf-hub:ORG/NAME' as the model name loads a Hugging Face Hub repo.")
# CIFAR-10 training-set channel statistics: the normalisation in the pretrained_cfg of every 32 x 32 model
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
# CIFAR-10's class names in the order of its labels (and of its class folders, sorted)
CIFAR10_LABELS = ('airplane', 'automobile', 'bird', 'cat', 'deer', 'dog', 'frog', 'horse', 'ship', 'truck')


class PretrainedWeightsError(RuntimeError):
    """Pretrained weights cannot be loaded; the message names the tag or file, what is wrong and the fix."""


def build_vit(model_cls: Type[ModelT], variant: str, pretrained: bool, filter_fn: Callable, **kwargs) -> ModelT:
    """timm's ``build_model_with_cfg`` for a ViT-shaped family, with the tag and the pretrained weights checked.

    ``features_only`` takes every block's output (getter features, ``out_indices`` the last 3 by default), as for
    timm's ViT. A tag that does not exist, or ``pretrained=True`` where the tag has no weights, raises naming the tags
    there are. A local weights file (the cfg's ``file``) is read by :func:`read_weights`; its classifier gives the
    number of classes of the weights and its stem their input channels, so a checkpoint of another number of classes
    or channels loads as it is, and a ``num_classes`` or ``in_chans`` that differs resets the head or adapts the stem
    as for timm's own weights. Weights of any source that do not fit the model raise naming what differs. The tag's
    class names stay only on a model they describe.
    """
    pretrained_cfg = kwargs.pop('pretrained_cfg', None)
    overlay = dict(kwargs.pop('pretrained_cfg_overlay', None) or {})
    strict = kwargs.pop('pretrained_strict', True)
    kwargs['feature_cfg'] = dict(out_indices=kwargs.pop('out_indices', 3), feature_cls='getter')
    if isinstance(pretrained_cfg, str) and f'{variant}.{pretrained_cfg}' not in get_arch_pretrained_cfgs(variant):
        raise PretrainedWeightsError(f"{variant} has no pretrained tag '{pretrained_cfg}'. {_tags(variant)}")
    own_file = 'file' in overlay and 'label_names' not in overlay
    check = filter_fn
    if pretrained:
        cfg = resolve_pretrained_cfg(variant, pretrained_cfg, dict(overlay))
        location = _weights_location(cfg, variant)
        if cfg.file and cfg.source not in ('hf-hub', 'local-dir') and cfg.state_dict is None and not cfg.custom_load:
            if 'file' not in overlay and not os.path.isfile(cfg.file):
                raise PretrainedWeightsError(
                    f'The weights of {variant}.{cfg.tag} ship with timm-hbf as {cfg.file}, which is missing: the '
                    'installation is incomplete. Reinstall timm-hbf (pip install --force-reinstall --no-deps '
                    'timm-hbf).')
            state_dict = overlay['state_dict'] = read_weights(cfg.file)  # timm loads it from memory: read once
            head, stem = state_dict.get(f'{cfg.classifier}.weight'), state_dict.get(f'{cfg.first_conv}.weight')
            if head is not None:
                overlay.setdefault('num_classes', head.shape[0])
            if stem is not None and stem.ndim == 4 and cfg.input_size is not None:  # the weights' input channels
                overlay.setdefault('input_size', (stem.shape[1], *cfg.input_size[1:]))

        def check(state_dict: Dict[str, Any], model: nn.Module) -> Dict[str, Any]:
            """The family's filter, then the check that the weights fit, apart from what timm adapts: the input layer
            (to ``in_chans``) and, where the number of classes differs, the classifier (left out)."""
            _check_prefix_tokens(state_dict, model, location, variant)
            state_dict = filter_fn(state_dict, model)
            _check_input_channels(state_dict, model, cfg.first_conv, location, variant)
            head_kept = not kwargs.get('features_only') and model.num_classes == overlay.get('num_classes',
                                                                                            cfg.num_classes)
            expected = model.state_dict()
            mismatch = state_dict_mismatch(expected, state_dict, strict=strict, any_shape=_names(cfg.first_conv),
                                           ignored=() if head_kept else _names(cfg.classifier))
            if not mismatch:
                return state_dict
            raise PretrainedWeightsError(f'{location} does not fit {variant} as built: {mismatch}. '
                                         f'{_fix(state_dict, expected)}')

    model = build_model_with_cfg(
        model_cls, variant, pretrained, pretrained_cfg=pretrained_cfg, pretrained_cfg_overlay=overlay,
        pretrained_filter_fn=check, pretrained_strict=strict, **kwargs)
    # No copy of the weights kept in the cfgs (the model's and, with features_only, the wrapped one's), and no class
    # names where they do not describe the weights: timm's inference.py would name another head's classes with them
    for module in model.modules():
        cfg = getattr(module, 'pretrained_cfg', None)
        if isinstance(cfg, dict):
            cfg.pop('state_dict', None)
            names = cfg.get('label_names')
            if names is not None and (own_file or getattr(module, 'num_classes', len(names)) != len(names)):
                cfg['label_names'] = cfg['label_descriptions'] = None
    return model


def read_weights(path: Union[str, Path], use_ema: bool = True) -> Dict[str, torch.Tensor]:
    """The state dict of a weights file, read by timm's ``load_state_dict``: a ``.safetensors`` file, or any other as
    a ``torch.save`` checkpoint unpickled weights only; of a train.py checkpoint its EMA weights where ``use_ema`` and
    it has some, else its weights. Raises :class:`PretrainedWeightsError` naming the file, the fault and the fix."""
    if not os.path.isfile(path):
        problem = 'is a folder, not a weights file' if os.path.isdir(path) else 'does not exist'
        raise PretrainedWeightsError(f'{path} {problem}. Name the weights file.')
    try:
        state_dict = load_state_dict(str(path), use_ema=use_ema)
    except Exception as e:
        refused = re.search(r'Unsupported globals: (.+?)\. No automatic', str(e))  # timm names what it did not unpickle
        if refused:
            raise PretrainedWeightsError(
                f'{path} holds Python objects besides tensors ({refused[1]}), which are not unpickled since that '
                'could run code. Save the state dict alone (model.state_dict()) with torch.save or '
                'safetensors.torch.save_file.') from e
        cause = e.__cause__ or e  # timm raises the unpickler's errors as its own, which blames globals
        detail = ' '.join(str(cause).split('WeightsUnpickler error:')[-1].split('Check the documentation')[0].split())
        raise PretrainedWeightsError(
            f'{path} cannot be read ({type(cause).__name__}: {detail}): it is cut short, damaged, or not of the '
            'format its name says (.safetensors for safetensors, any other for torch.save). Save or copy the weights '
            'again.') from e
    if not state_dict or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        raise PretrainedWeightsError(
            f'{path} holds no weights: it is neither a checkpoint of train.py nor a state dict (names to tensors). '
            'Name the file that train.py or torch.save(model.state_dict(), PATH) wrote.')
    return state_dict


def state_dict_mismatch(expected: Dict[str, torch.Tensor], given: Dict[str, torch.Tensor], strict: bool = True,
                        ignored: Iterable[str] = (), any_shape: Iterable[str] = (), shown: int = 3) -> str:
    """What keeps ``given`` (weights) from loading where ``expected`` (a model's state dict) is, in a few words, ''
    where nothing does: the names of ``expected`` it lacks (if ``strict``), those it has in addition, and those of
    another shape (but for ``any_shape``, an input layer that timm adapts), ``shown`` of each; ``ignored`` (a head
    that is replaced) left out on both sides."""
    def some(names: list) -> str:
        return ', '.join(names[:shown]) + (', ...' if len(names) > shown else '')

    ignored, any_shape = set(ignored), set(any_shape)
    missing = [k for k in expected if k not in given and k not in ignored] if strict else []
    unexpected = [k for k in given if k not in expected and k not in ignored]
    shapes = [f'{k} {tuple(given[k].shape)} for {tuple(v.shape)}' for k, v in expected.items()
              if k in given and k not in ignored | any_shape and given[k].shape != v.shape]
    return '; '.join(f'{len(names)} {what} ({some(names)})' for names, what in (
        (missing, 'missing'), (unexpected, 'unexpected'), (shapes, 'of another shape')) if names)


def _fix(state_dict: Dict[str, Any], expected: Dict[str, Any]) -> str:
    """How to build a model that weights of another architecture fit, where their names and shapes tell."""
    def depth(names: Iterable[str]) -> int:
        return len({name.split('.')[1] for name in names if name.startswith('blocks.') and '.query' not in name})

    def has(names: Iterable[str], part: str) -> bool:
        return any(part in name for name in names)

    width = [sd['pos_embed'].shape[-1] for sd in (state_dict, expected) if 'pos_embed' in sd]
    if len(width) == 2 and width[0] != width[1]:
        return f'The weights are {width[0]} wide, the model {width[1]}: create the model of their width (embed_dim).'
    if depth(state_dict) != depth(expected):
        return f'The weights have {depth(state_dict)} blocks, the model {depth(expected)}: create it with their depth.'
    if has(state_dict, '.ls1.') != has(expected, '.ls1.'):
        return ('The weights have layer scale (ls1, ls2): create the model with init_values (DeiT III: '
                'vit_attnres_deit3_*).' if has(state_dict, '.ls1.') else
                'The weights have no layer scale: create the model without init_values.')
    if has(state_dict, 'norm_pre.') != has(expected, 'norm_pre.'):
        return f'Create the model with pre_norm={has(state_dict, "norm_pre.")}, as the weights were trained.'
    if 'norm.weight' in state_dict and 'norm.weight' not in expected and 'fc_norm.weight' in expected:
        return ("The weights norm the tokens before the pooling (norm), the model after it (fc_norm, timm's ViT "
                "default with global_pool 'avg', 'max' or 'avgmax'): pass fc_norm=False to pool the tokens as the "
                'weights were trained to.')
    if 'fc_norm.weight' in state_dict and 'fc_norm.weight' not in expected:
        return ("The weights norm the pooled tokens (fc_norm, timm's ViT with global_pool 'avg'), which this model "
                'cannot: take weights of a ViT that norms its tokens before pooling (norm).')
    return ('Create the model the weights were trained as, with the same model arguments (those of train.py --model '
            'and --model-kwargs).')


def _check_prefix_tokens(state_dict: Dict[str, Any], model: nn.Module, location: str, variant: str) -> None:
    """Weights with another class token or other register tokens than the model raise naming the model arguments
    that fit them (timm's filter would resample their position embedding as the model's, and fail)."""
    if 'pos_embed' not in state_dict or not hasattr(model, 'num_prefix_tokens'):
        return
    registers = state_dict.get('reg_token')
    given = ('cls_token' in state_dict, 0 if registers is None else registers.shape[1])
    built = (getattr(model, 'cls_token', None) is not None, getattr(model, 'num_reg_tokens', 0))
    if given != built:
        def tokens(class_token: bool, reg_tokens: int) -> str:
            return f"{'a' if class_token else 'no'} class token and {reg_tokens} register tokens"
        pool = '' if given[0] else " (and a global_pool other than 'token')"
        raise PretrainedWeightsError(
            f'{location} does not fit {variant} as built: the weights have {tokens(*given)}, the model '
            f'{tokens(*built)}. Create the model with class_token={given[0]} and reg_tokens={given[1]}{pool}, as the '
            'weights were trained.')


def _check_input_channels(state_dict: Dict[str, Any], model: nn.Module, first_conv: Optional[str], location: str,
                          variant: str) -> None:
    """Before 1.0.31, timm adapts input weights of 3 channels to any number, and sums any into 1; it re-initialises
    the input layer (with a warning in the log) or fails to load all others, which raise here naming the fixes."""
    weight = state_dict.get(f'{first_conv}.weight')
    if ADAPTS_ANY_CHANNELS or not isinstance(weight, torch.Tensor) or weight.ndim != 4:
        return
    weights_chans, model_chans = weight.shape[1], model.get_submodule(first_conv).in_channels
    if weights_chans != 3 and model_chans != 1:
        raise PretrainedWeightsError(
            f'{location} has {weights_chans}-channel input weights ({first_conv}) and {variant} is built for '
            f'{model_chans}: timm before 1.0.31 adapts only 3-channel input weights (and any into 1 channel), and '
            'would re-initialise or refuse these. Create the model with in_chans=1, or upgrade timm to 1.0.31 or '
            'newer, which adapts any number.')


def _tags(variant: str) -> str:
    """The tags of ``variant``, those with weights first, and how to load other weights."""
    cfgs = get_arch_pretrained_cfgs(variant)
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
        raise PretrainedWeightsError(
            f'{variant}.{cfg.tag} has no pretrained weights. {_tags(variant)} Or create it with pretrained=False (in '
            "timm's scripts, without --pretrained).")
    return location


def _names(layer: Optional[str]) -> Set[str]:
    """The weight and bias names of a cfg's ``first_conv`` or ``classifier``."""
    return {f'{layer}.weight', f'{layer}.bias'} if isinstance(layer, str) else set()


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
