"""Create a model from a Hugging Face Hub repo with timm, its files checked first.

``timm.create_model('hf-hub:ORG/NAME', pretrained=True)`` loads our models as it loads timm's own.
:func:`create_model_from_hub` does the same after downloading and checking the files itself, so that every failure
says what to do and nothing corrupt stays in the cache.
"""
import hashlib
import json
from pathlib import Path
from typing import Optional, Tuple

import timm
from huggingface_hub import hf_hub_download
from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError
from torch import nn

from ..models._builder import PretrainedWeightsError, WeightsFileError, read_checkpoint
from .errors import HubError, hub_errors

__all__ = ['create_model_from_hub']

CONFIG_FILE = 'config.json'
SAFE_WEIGHTS_FILE = 'model.safetensors'
PICKLED_WEIGHTS_FILE = 'pytorch_model.bin'


def create_model_from_hub(repo: str, pretrained: bool = True, **kwargs) -> nn.Module:
    """``timm.create_model('hf-hub:' + repo, pretrained=pretrained, **kwargs)``, with the files checked first.

    Downloads ``config.json`` and the weights (``model.safetensors``, else ``pytorch_model.bin``, which must load as
    weights only), checks each against the hash the Hub announced (removing a corrupt download from the cache), checks
    that timm knows the architecture, then lets timm build the model from exactly those files. Failures raise
    :class:`HubError` naming the fix.

    Args:
        repo: ``ORG/NAME``, optionally ``@REVISION`` (branch, tag or commit); an ``hf-hub:`` prefix is allowed.
        pretrained: Load the weights.
        **kwargs: Passed to ``timm.create_model`` (``num_classes``, ``in_chans``, ``img_size``, ...).
    """
    repo_id, _, revision = repo.removeprefix('hf-hub:').partition('@')
    config = _download_checked(repo_id, CONFIG_FILE, revision or None)
    commit = config.parent.name  # the snapshot folder of the revision, named by its commit
    arch = json.loads(config.read_text())['architecture']
    if not timm.is_model(arch):
        raise HubError(
            f"{repo_id} holds a '{arch}', an architecture that timm {timm.__version__} does not know. If it is a "
            'timm-hbf model: pip install -U timm-hbf, and import timm_hbf before creating it.'
        )
    if pretrained:
        _download_weights(repo_id, commit)
    try:
        return timm.create_model(f'hf-hub:{repo_id}@{commit}', pretrained=pretrained, **kwargs)
    except RuntimeError as e:
        if kwargs and isinstance(e, PretrainedWeightsError):  # the arguments given here changed the model: it says how
            raise HubError(f'{e} (the model arguments given: {kwargs})') from e
        lines = [line.strip() for line in str(e).splitlines()]
        detail = ' '.join(lines[:2]) + (f' ... ({len(lines) - 2} more)' if len(lines) > 2 else '')
        raise HubError(
            f'The weights of {repo_id}@{commit} do not fit the {arch} its config.json describes ({detail}). The repo '
            'holds a checkpoint of another architecture or shape: push the checkpoint again with timm-hbf push.'
        ) from e


def _download_checked(repo_id: str, filename: str, revision: Optional[str] = None) -> Path:
    """``hf_hub_download`` into the cache, then check the file against the hash the Hub announced for it (its ETag:
    the sha256 of an LFS file, the git blob id of a regular one). A file that fails is removed from the cache."""
    with hub_errors(f'Downloading {filename} from', repo_id, revision):
        path = Path(hf_hub_download(repo_id, filename, revision=revision))
    blob = path.resolve()
    expected, actual = _hashes(blob)
    if actual is not None and actual != expected:
        path.unlink()
        blob.unlink()
        raise HubError(
            f'{filename} of {repo_id}@{revision or "main"} arrived corrupted: its content hashes to {actual}, the Hub '
            f'announced {expected}. The damaged download was removed from the cache; run again.'
        )
    return path


def _hashes(blob: Path) -> Tuple[str, Optional[str]]:
    """The hash the cache names ``blob`` by and the same hash of its content (None where the name is no hash)."""
    expected = blob.name
    if len(expected) == 64:
        digest = hashlib.sha256()
    elif len(expected) == 40:
        digest = hashlib.sha1(b'blob %d\0' % blob.stat().st_size)
    else:  # a copy instead of a link into the blobs (file systems without symlinks): nothing to check against
        return expected, None
    with blob.open('rb') as f:
        for chunk in iter(lambda: f.read(1 << 20), b''):
            digest.update(chunk)
    return expected, digest.hexdigest()


def _download_weights(repo_id: str, commit: str) -> None:
    """Download and check the weights timm will load: ``model.safetensors``, else ``pytorch_model.bin``, each
    complete and readable weights only."""
    missing = []
    for filename in (SAFE_WEIGHTS_FILE, PICKLED_WEIGHTS_FILE):
        try:
            path = _download_checked(repo_id, filename, commit)
        except HubError as e:
            if not isinstance(e.__cause__, EntryNotFoundError):
                raise
            missing.append(e)  # not in the repo, or out of reach (offline, server down): try the other
            continue
        try:
            read_checkpoint(path)
        except WeightsFileError as e:
            raise HubError(
                f'{filename} of {repo_id}@{commit} {e.problem}; it was not loaded. The repo holds it so: ask its '
                f'publisher to push the weights again, as {SAFE_WEIGHTS_FILE}.'
            ) from e
        return
    out_of_reach = [e for e in missing if isinstance(e.__cause__, LocalEntryNotFoundError)]
    if out_of_reach:
        raise out_of_reach[0]
    raise HubError(f'{repo_id}@{commit} has no weights: neither {SAFE_WEIGHTS_FILE} nor {PICKLED_WEIGHTS_FILE}. '
                   'Create the model with pretrained=False.')
