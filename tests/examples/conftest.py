"""Loading an example script as a module, with its folder on ``sys.path`` for the neighbours it imports."""
import sys
from types import ModuleType
from typing import Callable, Iterator

import pytest

from tests.helpers import ROOT, load_module

EXAMPLES = ROOT / 'examples'


@pytest.fixture
def load_example(monkeypatch) -> Iterator[Callable[[str], ModuleType]]:
    """``load_example('name.py')``: the script as a module; ``train_cifar10``, which scripts import, is forgotten
    afterwards."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    yield lambda name: load_module(EXAMPLES / name)
    sys.modules.pop('train_cifar10', None)
