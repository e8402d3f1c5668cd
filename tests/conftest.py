"""What tests across the package share: the real-data sample (the mini CIFAR-10 archive committed with the repository)
and both kinds of timm's gradient checkpointing."""
import tarfile
from pathlib import Path

import pytest
from timm.layers import set_reentrant_ckpt, use_reentrant_ckpt

from tests.helpers import ROOT

CIFAR10_SAMPLE = ROOT / 'data' / 'cifar10-mini-jpeg.tar.gz'  # 100 train and 20 test JPEGs of every class


@pytest.fixture(scope='session')
def cifar10_sample(tmp_path_factory) -> Path:
    """The sample extracted once: ``train/`` (1,000 images) and ``test/`` (200), one folder per class."""
    root = tmp_path_factory.mktemp('cifar10_sample')
    with tarfile.open(CIFAR10_SAMPLE) as tar:
        tar.extractall(root, **({'filter': 'data'} if hasattr(tarfile, 'data_filter') else {}))
    return root


@pytest.fixture(params=[False, True], ids=['non_reentrant', 'reentrant'])
def checkpointing_reentrant(request) -> bool:
    """timm's gradient checkpointing non-reentrant (its default) or reentrant (``timm.layers.set_reentrant_ckpt``,
    which tracks only tensors passed as arguments), for the test; restored after it."""
    before = use_reentrant_ckpt()
    set_reentrant_ckpt(request.param)
    yield request.param
    set_reentrant_ckpt(before)
