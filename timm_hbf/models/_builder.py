"""Build models with timm's ``build_model_with_cfg``, and the pretrained cfgs the families share.

timm resolves, reads and loads the weights. Where it would go on with wrong weights or its error would not say what to
do, :class:`PretrainedWeightsError` names the tag or file, the fault and the fix: a tag that does not exist or has no
weights, a weights file that cannot be read, weights that do not fit the model as built.
"""
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Type, TypeVar, Union

import torch
from timm.data import IMAGENET_INCEPTION_MEAN, IMAGENET_INCEPTION_STD
from timm.models import build_model_with_cfg, get_arch_pretrained_cfgs, load_state_dict, resolve_pretrained_cfg
from torch import nn

__all__ = ['CIFAR10_LABELS', 'CIFAR10_MEAN', 'CIFAR10_STD', 'PretrainedWeightsError', 'build_vit', 'cifar10_weights',
           'read_weights', 'state_dict_mismatch', 'vit_cfg']

ModelT = TypeVar('ModelT', bound=nn.Module)
# CIFAR-10 training-set channel statistics, and its class names in label order
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR10_LABELS = ('airplane', 'automobile', 'bird', 'cat', 'deer', 'dog', 'frog', 'horse', 'ship', 'truck')


class PretrainedWeightsError(RuntimeError):
    """Pretrained weights cannot be loaded; the message names the tag or file, what is wrong and the fix."""


def build_vit(model_cls: Type[ModelT], variant: str, pretrained: bool, filter_fn: Callable, **kwargs) -> ModelT:
    """timm's ``build_model_with_cfg`` for a ViT-shaped family: ``filter_fn`` maps the weights, then they must fit the
    model as built (timm adapts the stem to ``in_chans`` and drops a head of another number of classes).
    ``features_only`` takes blocks' outputs (getter features, the last 3 by default) as for timm's ViT."""
    tag, overlay = kwargs.get('pretrained_cfg'), kwargs.get('pretrained_cfg_overlay') or {}
    kwargs['feature_cfg'] = dict(out_indices=kwargs.pop('out_indices', 3), feature_cls='getter')
    if isinstance(tag, str) and f'{variant}.{tag}' not in get_arch_pretrained_cfgs(variant):
        raise PretrainedWeightsError(f"{variant} has no pretrained tag '{tag}'. {_tags(variant)}")
    if pretrained:
        cfg = resolve_pretrained_cfg(variant, tag, dict(overlay))
        location = cfg.file or (cfg.hf_hub_id and f'hf-hub:{cfg.hf_hub_id}') or cfg.url
        if not location and cfg.state_dict is None:
            raise PretrainedWeightsError(f"{variant}.{cfg.tag} has no weights. {_tags(variant)} Or create it with "
                                         "pretrained=False (in timm's scripts, without --pretrained).")
        if cfg.file and cfg.source not in ('hf-hub', 'local-dir'):  # read here for errors naming it; timm loads it
            kwargs['pretrained_cfg_overlay'] = dict(overlay, state_dict=read_weights(cfg.file))

        def check(state_dict: Dict[str, Any], model: nn.Module) -> Dict[str, Any]:
            _check_prefix_tokens(state_dict, model, location, variant)
            state_dict = filter_fn(state_dict, model)
            head_kept = not kwargs.get('features_only') and model.num_classes == cfg.num_classes
            expected = model.state_dict()
            mismatch = state_dict_mismatch(expected, state_dict, strict=kwargs.get('pretrained_strict', True),
                                           any_shape=_names(cfg.first_conv),
                                           ignored=() if head_kept else _names(cfg.classifier))
            if mismatch:
                raise PretrainedWeightsError(f'{location} does not fit {variant} as built: {mismatch}. '
                                             f'{_fix(state_dict, expected, cfg.classifier)}')
            return state_dict
        kwargs['pretrained_filter_fn'] = check
    model = build_model_with_cfg(model_cls, variant, pretrained, **kwargs)
    # no copy of the weights kept in the cfgs, and no class names where they would name another head's classes
    own_file = 'file' in overlay and 'label_names' not in overlay
    for module in model.modules():
        cfg = getattr(module, 'pretrained_cfg', None)
        if isinstance(cfg, dict):
            cfg.pop('state_dict', None)
            names = cfg.get('label_names')
            if names is not None and (own_file or getattr(module, 'num_classes', len(names)) != len(names)):
                cfg['label_names'] = cfg['label_descriptions'] = None
    return model


def read_weights(path: Union[str, Path], use_ema: bool = True) -> Dict[str, torch.Tensor]:
    """The state dict of a weights file as timm's ``load_state_dict`` reads it (``.safetensors``, else ``torch.load``
    weights only; a train.py checkpoint's EMA weights where ``use_ema`` and it has some); raises
    :class:`PretrainedWeightsError` naming the file, the fault and the fix."""
    if not Path(path).is_file():
        raise PretrainedWeightsError(f'{path} is no weights file ({"a folder" if Path(path).is_dir() else "missing"}).'
                                     ' Name the file that train.py, torch.save or safetensors wrote.')
    try:
        state_dict = load_state_dict(str(path), use_ema=use_ema)
    except Exception as e:
        raise PretrainedWeightsError(
            f'{path} cannot be read as weights ({type(e).__name__}): it is damaged, holds Python objects beside '
            'tensors (never unpickled: save model.state_dict() alone), or is not of the format its name says '
            '(.safetensors, else torch.save).') from e
    if not state_dict or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        raise PretrainedWeightsError(f'{path} holds no weights (names to tensors): name the file that train.py or '
                                     'torch.save(model.state_dict(), PATH) wrote.')
    return state_dict


def state_dict_mismatch(expected: Dict[str, torch.Tensor], given: Dict[str, torch.Tensor], strict: bool = True,
                        ignored: Iterable[str] = (), any_shape: Iterable[str] = (), shown: int = 3) -> str:
    """What keeps ``given`` from loading into a model whose state dict is ``expected``, '' where nothing does: the
    names it lacks (if ``strict``), has in addition, or has in another shape (but ``any_shape``), ``shown`` of each;
    ``ignored`` (a replaced head) left out."""
    ignored, any_shape = set(ignored), set(any_shape)
    missing = [k for k in expected if k not in given and k not in ignored] if strict else []
    unexpected = [k for k in given if k not in expected and k not in ignored]
    shapes = [f'{k} {tuple(given[k].shape)} for {tuple(v.shape)}' for k, v in expected.items()
              if k in given and k not in ignored | any_shape and given[k].shape != v.shape]
    return '; '.join(f'{len(names)} {what} ({", ".join(names[:shown])}{", ..." if len(names) > shown else ""})'
                     for names, what in ((missing, 'missing'), (unexpected, 'unexpected'), (shapes, 'of another shape'))
                     if names)


def _fix(given: Dict[str, Any], expected: Dict[str, Any], classifier: str) -> str:
    """How to build a model that weights of another architecture fit, where their names and shapes tell."""
    def depth(sd):
        return len({k.split('.')[1] for k in sd if k.startswith('blocks.') and '.query' not in k})

    def has(sd, part):
        return any(part in k for k in sd)

    width = [sd['pos_embed'].shape[-1] for sd in (given, expected) if 'pos_embed' in sd]
    head = [sd[f'{classifier}.weight'].shape[0] for sd in (given, expected) if f'{classifier}.weight' in sd]
    if len(width) == 2 and width[0] != width[1]:
        return f'The weights are {width[0]} wide, the model {width[1]}: create it with embed_dim={width[0]}.'
    if depth(given) != depth(expected):
        return f'The weights have {depth(given)} blocks, the model {depth(expected)}: create it with their depth.'
    if has(given, '.ls1.') != has(expected, '.ls1.'):
        return ('Create the model with init_values (layer scale; DeiT III: vit_attnres_deit3_*), as the weights have.'
                if has(given, '.ls1.') else 'The weights have no layer scale: create the model without init_values.')
    if has(given, 'norm_pre.') != has(expected, 'norm_pre.'):
        return f'Create the model with pre_norm={has(given, "norm_pre.")}, as the weights were trained.'
    if 'norm.weight' in given and 'fc_norm.weight' in expected:
        return 'The weights norm the tokens before pooling: create the model with fc_norm=False.'
    if 'fc_norm.weight' in given and 'fc_norm.weight' not in expected:
        return 'The weights norm the pooled tokens (fc_norm), which this model cannot: take weights that use norm.'
    if len(head) == 2 and head[0] != head[1]:
        return (f'The weights have {head[0]} classes: create the model with num_classes={head[0]}, and give '
                f'num_classes={head[0]} in pretrained_cfg_overlay too (train.py --pretrained-path replaces the head).')
    return 'Create the model the weights were trained as (the model arguments of train.py --model-kwargs).'


def _check_prefix_tokens(state_dict: Dict[str, Any], model: nn.Module, location: str, variant: str) -> None:
    """Weights with another class token or other register tokens than the model raise naming the arguments that fit
    them (the family's filter would resample their position embedding as the model's, and fail)."""
    if 'pos_embed' not in state_dict or not hasattr(model, 'num_prefix_tokens'):
        return
    registers = state_dict.get('reg_token')
    given = ('cls_token' in state_dict, 0 if registers is None else registers.shape[1])
    built = (getattr(model, 'cls_token', None) is not None, getattr(model, 'num_reg_tokens', 0))
    if given != built:
        pool = '' if given[0] else " and a global_pool other than 'token'"
        raise PretrainedWeightsError(
            f'{location} does not fit {variant} as built: the weights have class token {given[0]} and {given[1]} '
            f'register tokens, the model {built[0]} and {built[1]}. Create it with class_token={given[0]}, '
            f'reg_tokens={given[1]}{pool}.')


def _tags(variant: str) -> str:
    """The tags of ``variant``, those with weights first, and how to load other weights."""
    cfgs = get_arch_pretrained_cfgs(variant)
    with_weights = [name for name, cfg in cfgs.items() if cfg.has_weights]
    without = [name for name in cfgs if name not in with_weights]
    return (f'Tags with weights: {", ".join(with_weights) or "none"}; without: {", ".join(without) or "none"}. Load '
            "your own with pretrained_cfg_overlay=dict(file=PATH) (train.py --pretrained-path), or 'hf-hub:ORG/NAME'.")


def _names(layer: Any) -> set:
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
    """The cfg entries of the CIFAR-10 weights ``MODEL.TAG`` in the wheel: the file (bf16 but the kernel widths; timm
    loads it into float32 models) and the class names in classifier order (which timm's inference.py reads)."""
    return dict(file=str(Path(__file__).resolve().parents[1] / 'weights' / f'{name}.safetensors'),
                label_names=CIFAR10_LABELS)
