"""Loading an example script as a module, with its folder on ``sys.path`` for the neighbours it imports."""
import sys
from typing import Callable

import pytest
import torch

from tests.helpers import ROOT, load_module


@pytest.fixture
def example(monkeypatch):
    """``example('name.py')``: the script as a module; torch's thread count restored (the scripts set it)."""
    monkeypatch.syspath_prepend(str(ROOT / 'examples'))
    threads = torch.get_num_threads()
    yield lambda name: load_module(ROOT / 'examples' / name)
    torch.set_num_threads(threads)
    for neighbour in ('train_cifar10', 'script_checks'):
        sys.modules.pop(neighbour, None)


@pytest.fixture
def usage_error(capsys) -> Callable[[Callable[[], object]], str]:
    """``usage_error(call)``: the one line ``call`` exits with (``parser.error`` or ``SystemExit('message')``), no
    traceback."""
    def exit_line(call: Callable[[], object]) -> str:
        with pytest.raises(SystemExit) as exit_info:
            call()
        message = capsys.readouterr().err.strip() if exit_info.value.code == 2 else str(exit_info.value.code)
        assert 'Traceback' not in message
        return message.splitlines()[-1]
    return exit_line
