"""The argument checks the example scripts share: a bad argument exits with one line that names it, its value and the
fix (``parser.error``), before anything is built, trained or measured."""
import argparse
import difflib
import gzip
import os
import tarfile
import zlib
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence

import timm
from timm.models import get_arch_pretrained_cfgs, get_pretrained_cfg, parse_model_name, split_model_name_tag

OUR_MODULES = ['vit_hyperbf', 'vit_qimia', 'vit_attnres']  # the timm modules our models register in
ARCHIVE_ERRORS = (tarfile.TarError, EOFError, gzip.BadGzipFile, zlib.error)  # what a damaged .tar.gz raises


def model_problem(name: str, weights: bool = False) -> Optional[str]:
    """Why ``timm.create_model(name, pretrained=weights)`` cannot find the model, or None: an architecture timm does
    not know, a tag it does not have, or (``weights``) a tag without weights. A name with a source (``hf-hub:``,
    ``local-dir:``) is checked where it loads."""
    try:
        source, _ = parse_model_name(name)
    except ValueError as e:  # an unknown source, or a path without one
        return str(e)
    if source:
        return None
    arch, tag = split_model_name_tag(name)
    if not timm.is_model(arch):
        close = difflib.get_close_matches(arch, timm.list_models(), n=3)
        hint = f'did you mean {" or ".join(close)}? ' if close else ''
        return f'timm knows no such model ({hint}see timm.list_models(module={OUR_MODULES}) for ours)'
    cfgs = get_arch_pretrained_cfgs(arch)
    if tag and name not in cfgs:
        return f"{arch} has no tag '{tag}' (its tags: {', '.join(cfgs) or 'none'})"
    cfg = cfgs[name] if tag else get_pretrained_cfg(arch)
    if weights and (cfg is None or not cfg.has_weights):
        with_weights = [n for n, c in cfgs.items() if c.has_weights]
        return f"{name} has no pretrained weights (tags with weights: {', '.join(with_weights) or 'none'})"
    return None


def check_models(parser: argparse.ArgumentParser, option: str, names: Sequence[str], weights: bool = False) -> None:
    """``parser.error`` naming the first of ``names`` that timm cannot create (see :func:`model_problem`)."""
    for name in names:
        problem = model_problem(name, weights)
        if problem:
            parser.error(f'{option} {name}: {problem}')


def check_model_kwargs(parser: argparse.ArgumentParser, name: str, kwargs: Dict[str, Any], **fixed: Any) -> None:
    """``parser.error`` naming ``--model-kwargs`` where ``name`` cannot be built with them (and the script's own
    ``fixed`` arguments; built on the meta device: no memory, no time)."""
    if not kwargs:
        return
    try:
        timm.create_model(name, device='meta', **kwargs, **fixed)
    except (TypeError, ValueError) as e:
        items = ' '.join(f'{k}={v!r}' for k, v in kwargs.items())
        parser.error(f'--model-kwargs {items}: {name} cannot be built with them ({e})')


def check_counts(parser: argparse.ArgumentParser, args: argparse.Namespace, **lowest: int) -> None:
    """``parser.error`` for the first of the integer arguments ``lowest`` names (by dest) that is below its lowest
    value (an argument left out, None, passes): ``check_counts(parser, args, epochs=1)``."""
    for dest, low in lowest.items():
        value = getattr(args, dest)
        if value is not None and value < low:
            parser.error(f"--{dest.replace('_', '-')} must be an integer >= {low}, got {value}")


def check_data(parser: argparse.ArgumentParser, data: str) -> Path:
    """``--data`` as a path: a folder or a tar archive, else ``parser.error`` (what it holds is checked where it is
    read)."""
    path = Path(data).expanduser()
    if not path.exists():
        parser.error(f'--data {data}: no such file or folder')
    try:
        readable = path.is_dir() or tarfile.is_tarfile(path)
    except OSError:
        readable = False
    if not readable:
        parser.error(f'--data {data}: neither a folder nor a readable archive. Give a CIFAR-10 folder or .tar.gz '
                     'archive in the ImageFolder layout (train/<class>/*.jpg, test/<class>/*.jpg).')
    return path


def check_output(parser: argparse.ArgumentParser, option: str, path: Path, folder: bool = False) -> None:
    """``parser.error`` unless ``path`` can be written: an existing file (or with ``folder`` a folder) or a new one
    whose nearest existing parent is a writable folder. Checked before anything is computed."""
    full = path.expanduser().absolute()
    if full.exists() and full.is_dir() != folder:
        parser.error(f"{option} {path}: {'a file, not a folder' if folder else 'a folder: name a file in it'}")
    existing = next(p for p in (full, *full.parents) if p.exists())
    if not existing.is_dir():
        parser.error(f'{option} {path}: {existing} is a file, not a folder')
    if not os.access(existing, os.W_OK | os.X_OK):
        parser.error(f'{option} {path}: {existing} is not writable')


def extract_archive(archive: Path, dest: Path, keep: Callable[[tarfile.TarInfo], bool] = lambda member: True) -> None:
    """Extract the members of ``archive`` that ``keep`` keeps into ``dest``; a damaged archive exits naming it."""
    kwargs = {'filter': 'data'} if hasattr(tarfile, 'data_filter') else {}
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(dest, members=[m for m in tar.getmembers() if keep(m)], **kwargs)
    except ARCHIVE_ERRORS as e:
        raise SystemExit(f'--data {archive}: a damaged archive ({type(e).__name__}: {e}). Download or copy it again.')
