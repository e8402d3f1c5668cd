"""Argument checks of the layers and models, for values that would otherwise build a silently wrong model or fail deep
inside. Each raises naming the argument, the value and what is allowed:

    {name} must be {allowed}, got {value!r}.            ValueError: a value out of range or not among the choices
    {name} must be {allowed}, got {value!r} ({type}).   TypeError: a value of the wrong kind

Bools are not numbers here: ``True`` is refused where a count or a rate is asked for.
"""
import math
import numbers
from typing import Any, Callable, Mapping, NoReturn, Sequence, Type

__all__ = ['check_choice', 'check_count', 'check_divisor', 'check_number', 'check_positive', 'check_rate',
           'check_vit_arguments', 'fail']


def fail(name: str, value: Any, allowed: str, error: Type[Exception] = ValueError) -> NoReturn:
    kind = f' ({type(value).__name__})' if error is TypeError else ''
    raise error(f'{name} must be {allowed}, got {value!r}{kind}.')


def check_number(name: str, value: Any, kind: type, ok: Callable[[Any], bool], allowed: str) -> None:
    """A TypeError unless ``value`` is of ``kind`` (and no bool), a ValueError unless ``ok(value)``."""
    if isinstance(value, bool) or not isinstance(value, kind):
        fail(name, value, allowed, TypeError)
    if not ok(value):
        fail(name, value, allowed)


def check_count(name: str, value: Any, low: int = 1) -> None:
    """An integer >= ``low``."""
    check_number(name, value, numbers.Integral, lambda v: v >= low, f'an integer >= {low}')


def check_divisor(name: str, value: int, of_name: str, of_value: int) -> None:
    """A divisor of ``of_value`` (both already counts), as the number of heads a width is split into must be."""
    if of_value % value:
        fail(name, value, f'a divisor of {of_name} ({of_value})')


def check_positive(name: str, value: Any) -> None:
    """A finite real number > 0."""
    check_number(name, value, numbers.Real, lambda v: v > 0 and math.isfinite(v), 'a finite number > 0')


def check_rate(name: str, value: Any) -> None:
    """A dropout rate: a real number in [0, 1)."""
    check_number(name, value, numbers.Real, lambda v: 0 <= v < 1, 'a rate in [0, 1)')


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> None:
    """One of ``choices``."""
    if value not in choices:
        fail(name, value, f'one of {tuple(choices)}')


def check_vit_arguments(args: Mapping[str, Any]) -> None:
    """The arguments of timm's ``VisionTransformer`` that both families take, those of them in ``args``: timm's ViT
    builds a model without blocks at ``depth=0`` and one without a head at ``num_classes=-1``, drops every path at
    ``drop_path_rate=1``, and fails deep inside on a string ``img_size`` or a fractional count."""
    for name, low in (('in_chans', 1), ('num_classes', 0), ('embed_dim', 1), ('depth', 1), ('num_heads', 1),
                      ('reg_tokens', 0)):
        if name in args:
            check_count(name, args[name], low)
    for name in ('img_size', 'patch_size'):
        value = args.get(name, 1)
        pair = tuple(value) if isinstance(value, (tuple, list)) else (value, value)
        if len(pair) != 2 or not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 1
                                     for v in pair):
            fail(name, value, 'an integer >= 1 or a pair of them (height, width)')
    for name in ('drop_rate', 'pos_drop_rate', 'proj_drop_rate', 'attn_drop_rate', 'drop_path_rate'):
        if name in args:
            check_rate(name, args[name])
