"""Push a train.py checkpoint to the Hugging Face Hub as a timm model repo: timm's ``save_for_hf`` files
(``config.json``, ``model.safetensors``) and a model card with its training-curve image, in one commit of
huggingface_hub's ``upload_folder``."""
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch
from huggingface_hub import CommitInfo, HfApi, constants, get_token
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, HTTPError
from huggingface_hub.utils import validate_repo_id
from safetensors import SafetensorError
from timm.data import resolve_data_config
from timm.models import save_for_hf

from .. import __version__
from .errors import HubError
from .model_card import CURVES_FILE, model_card, plot_training_curves
from .train_output import TrainOutput

__all__ = ['FLOAT32_PARAM_NAMES', 'check_repo_id', 'push_to_hub', 'to_storage_dtype', 'write_repo_folder']

# Kept in float32 whatever the file's dtype: the kernel widths are exponents (gamma = exp(log_gamma) scales squared
# distances), which bf16 rounding of log_gamma would move by up to a percent, and they are few.
FLOAT32_PARAM_NAMES = ('log_gamma',)


def to_storage_dtype(model: torch.nn.Module, dtype: torch.dtype,
                     keep_float32: Sequence[str] = FLOAT32_PARAM_NAMES) -> torch.nn.Module:
    """Cast ``model`` in place to ``dtype``, the dtype its weights file is written in, but for the parameters whose
    last name is in ``keep_float32`` (the kernel widths), which stay float32 with the values they had."""
    kept = {name: param.detach().float().clone() for name, param in model.named_parameters()
            if name.rsplit('.', 1)[-1] in keep_float32}
    model.to(dtype)
    for name, value in kept.items():
        model.get_parameter(name).data = value
    return model


def check_repo_id(repo_id: str) -> str:
    """``repo_id`` if it is a Hub model repo id ``ORG/NAME``; else raises :class:`HubError` saying what one is."""
    try:
        validate_repo_id(repo_id)
        valid = repo_id.count('/') == 1
    except HFValidationError:
        valid = False
    if not valid:
        raise HubError(f"repo_id must be ORG/NAME: names of letters, digits, '-', '_' and '.', neither starting nor "
                       "ending with '-' or '.', without '--' or '..', at most 96 characters each, NAME not ending in "
                       f"'.git', got {repo_id!r}.")
    return repo_id


def write_repo_folder(train: TrainOutput, folder: Union[str, Path], repo_id: str,
                      label_names: Optional[Sequence[str]] = None, pytorch_bin: bool = False,
                      dtype: Optional[torch.dtype] = None) -> Path:
    """Write the files of the model repo for ``train`` into the new folder ``folder``, all or nothing: timm's
    ``config.json`` and ``model.safetensors`` (and ``pytorch_model.bin`` with ``pytorch_bin``), the model card
    ``README.md`` for ``repo_id`` and, where the run has a ``summary.csv``, its training curves. ``dtype`` writes the
    weights in that dtype as :func:`to_storage_dtype` casts them (timm casts them back to the model's dtype as it loads
    them); ``label_names`` are the class names, in classifier order."""
    folder = Path(folder)
    if folder.exists():
        raise HubError(f'{folder} already exists: name a new folder.')
    return _write_repo_folder(train, folder, repo_id, label_names, pytorch_bin, dtype)


def _write_repo_folder(train: TrainOutput, folder: Path, repo_id: str, label_names: Optional[Sequence[str]],
                       pytorch_bin: bool, dtype: Optional[torch.dtype], where: str = 'a writable folder') -> Path:
    check_repo_id(repo_id)
    model = train.create_model()
    if dtype is not None:
        to_storage_dtype(model, dtype)
    if label_names is not None and len(label_names) != model.num_classes:
        raise HubError(f'{len(label_names)} label names for the {model.num_classes} classes of {train.checkpoint}.')
    # The input of the model as built, then the preprocessing of train.py's evaluation; no tag and no class names:
    # the registry's describe its own weights, not these (label_names gives theirs).
    input_cfg, input_args = _input_of(model)
    model.pretrained_cfg.update(input_cfg)
    model.pretrained_cfg.update(resolve_data_config(train.args, model=model))
    for key in ('tag', 'label_names', 'label_descriptions'):
        model.pretrained_cfg.pop(key, None)
    try:
        folder.mkdir(parents=True)
        try:
            save_for_hf(model, folder, model_config={'label_names': list(label_names)} if label_names else None,
                        model_args={**input_args, **train.model_kwargs},
                        safe_serialization='both' if pytorch_bin else True)
            # The number of classes at the top level only: transformers' timm wrapper passes that one to create_model
            # beside model_args, and a copy there fails with "got multiple values for keyword argument 'num_classes'".
            config = json.loads((folder / 'config.json').read_text())
            config.get('model_args', {}).pop('num_classes', None)
            (folder / 'config.json').write_text(json.dumps(config, indent=2))
            if train.summary:
                plot_training_curves(train.summary, folder / CURVES_FILE, title=f'{repo_id} ({train.arch})',
                                     epoch=train.epoch)
            (folder / 'README.md').write_text(model_card(repo_id, model, train, label_names), encoding='utf-8')
        except BaseException:
            shutil.rmtree(folder)
            raise
    except (OSError, SafetensorError) as e:  # a read-only place, a full disk (safetensors reports it as its own)
        raise HubError(f'cannot write {folder}: {e}. Choose {where} with free space.') from e
    return folder


def _input_of(model: torch.nn.Module) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """The input a ViT-shaped ``model`` takes as built, which ``img_size``, ``in_chans`` and ``dynamic_img_size`` can
    make differ from its tag's: as pretrained-cfg entries (the tag's normalisation averaged over the channels where
    their number differs) and as the model arguments that rebuild it at that size."""
    proj = getattr(getattr(model, 'patch_embed', None), 'proj', None)
    if not isinstance(proj, torch.nn.Conv2d):
        return {}, {}
    channels, size, cfg = proj.in_channels, tuple(model.patch_embed.img_size), model.pretrained_cfg
    found = dict(input_size=(channels, *size), fixed_input_size=not getattr(model, 'dynamic_img_size', False))
    for key in ('mean', 'std'):
        if cfg.get(key) is not None and len(cfg[key]) != channels:
            found[key] = (sum(cfg[key]) / len(cfg[key]),) * channels
    return found, dict(img_size=list(size), in_chans=channels)


def push_to_hub(train: TrainOutput, repo_id: str, label_names: Optional[Sequence[str]] = None, private: bool = False,
                revision: Optional[str] = None, create_pr: bool = False, pytorch_bin: bool = False,
                dtype: Optional[torch.dtype] = None) -> CommitInfo:
    """Push the files of :func:`write_repo_folder` to the Hub repo ``repo_id`` (``ORG/NAME``) in one commit, to the
    branch ``revision`` (default: main) or, with ``create_pr``, as a pull request. The repo (``private`` if asked) and
    the branch are created if missing; the model card is written anew on every push."""
    if constants.HF_HUB_OFFLINE:
        raise HubError(f'Pushing to {repo_id} needs the network, but HF_HUB_OFFLINE=1 is set: unset HF_HUB_OFFLINE '
                       'to push (timm-hbf push --dry-run writes the files without pushing).')
    api = HfApi(library_name='timm-hbf', library_version=__version__)
    epoch = f', epoch {train.epoch}' if train.epoch is not None else ''
    with tempfile.TemporaryDirectory() as tmp:
        folder = _write_repo_folder(train, Path(tmp) / 'repo', repo_id, label_names, pytorch_bin, dtype,
                                    where='a temporary folder (TMPDIR)')
        try:
            repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
            if revision is not None:
                api.create_branch(repo_id, branch=revision, exist_ok=True)
            return api.upload_folder(repo_id=repo_id, folder_path=folder, revision=revision, create_pr=create_pr,
                                     commit_message=f'Add {train.arch} weights ({train.checkpoint.name}{epoch})')
        except Exception as err:
            why = _why_failed(err, repo_id)
            if why is None:
                raise
            raise HubError(f'Pushing to {repo_id}@{revision or "main"} failed: {why}') from err


def _why_failed(err: BaseException, repo_id: str) -> Optional[str]:
    """What the Hub client's HTTP or connection error ``err`` (or the first cause that is one: the client wraps some in
    a RuntimeError) means and what to do, in a few words; None for other errors."""
    while err is not None and not isinstance(err, (OSError, HTTPError)):  # HTTPError: that of the HTTP library
        err = err.__cause__
    if err is None:
        return None
    status = err.response.status_code if isinstance(err, HfHubHTTPError) and err.response is not None else None
    if status is None:  # no answer: the connection could not be opened, or it broke off
        return (f'no answer from {constants.ENDPOINT} ({type(err).__name__}: {err}). Check the network connection, '
                'the proxy settings and HF_ENDPOINT, and run again.')
    if status in (401, 403):
        who = 'you are not logged in' if get_token() is None else 'the Hub refused your token'
        return (f'{who} (HTTP {status}): log in with `hf auth login` or set HF_TOKEN to a token with write access to '
                f'{repo_id.split("/")[0]}.')
    return f'{constants.ENDPOINT} answered HTTP {status} ({str(err).splitlines()[0]}). Run again later.'
