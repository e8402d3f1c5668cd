"""Data for the training tests: a small ImageFolder cut from the mini CIFAR-10 archive of ../shared/datasets."""
import tarfile
from collections import defaultdict
from pathlib import Path

import pytest

MINI = Path(__file__).resolve().parents[3] / 'shared' / 'datasets' / 'cifar10-mini-jpeg.tar.gz'
PER_CLASS = {'train': 4, 'test': 2}  # images of each class per split: batches of 8 give 5 train and 3 eval batches


@pytest.fixture(scope='session')
def cifar10_tiny(tmp_path_factory) -> Path:
    """``train/`` (40 images) and ``test/`` (20 images) of real CIFAR-10, one folder per class."""
    if not MINI.is_file():
        pytest.fail(f'The training tests need the mini CIFAR-10 archive at {MINI} (../shared/datasets).', pytrace=False)
    root = tmp_path_factory.mktemp('cifar10_tiny')
    taken = defaultdict(int)
    with tarfile.open(MINI) as tar:
        members = []
        for m in tar.getmembers():
            parts = Path(m.name).parts
            if m.isfile() and len(parts) == 3 and taken[parts[:2]] < PER_CLASS.get(parts[0], 0):
                taken[parts[:2]] += 1
                members.append(m)
        tar.extractall(root, members=members, **({'filter': 'data'} if hasattr(tarfile, 'data_filter') else {}))
    return root
