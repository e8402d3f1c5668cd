"""Session fixtures: the real-data sample every test reads (the mini CIFAR-10 archive committed with the repository),
the project's wheel, and a virtual environment it is installed in."""
import tarfile
from pathlib import Path

import pytest

from tests.helpers import ROOT, build_distribution, install

CIFAR10_SAMPLE = ROOT / 'data' / 'cifar10-mini-jpeg.tar.gz'  # 100 train and 20 test JPEGs of every class


@pytest.fixture(scope='session')
def cifar10_sample(tmp_path_factory) -> Path:
    """The sample extracted once: ``train/`` (1,000 images) and ``test/`` (200), one folder per class."""
    root = tmp_path_factory.mktemp('cifar10_sample')
    with tarfile.open(CIFAR10_SAMPLE) as tar:
        tar.extractall(root, **({'filter': 'data'} if hasattr(tarfile, 'data_filter') else {}))
    return root


@pytest.fixture(scope='session')
def built_wheel(tmp_path_factory) -> Path:
    """The project's wheel, built once for the tests that install or measure it."""
    return build_distribution('wheel', tmp_path_factory.mktemp('wheel'))


@pytest.fixture(scope='session')
def wheel_env(built_wheel, tmp_path_factory) -> Path:
    """A new virtual environment outside the repository with the wheel installed (not editable), as a user installs
    it; torch, timm and the rest are this environment's (:func:`tests.helpers.install`)."""
    env = tmp_path_factory.mktemp('wheel_env') / 'venv'
    assert not env.is_relative_to(ROOT), f'{env} lies in the repository: give pytest a --basetemp outside it'
    return install(env, built_wheel)
