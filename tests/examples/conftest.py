"""Loading an example script as a module, with its folder on ``sys.path`` for the neighbours it imports."""
import sys
from types import ModuleType
from typing import Callable, Iterator

import pytest

from tests.helpers import ROOT, load_module

EXAMPLES = ROOT / 'examples'


@pytest.fixture(scope='module')
def load_example() -> Iterator[Callable[[str], ModuleType]]:
    """``load_example('name.py')``: the script as a module (also in a test module's own module-scoped fixtures);
    ``train_cifar10`` and ``script_checks``, which scripts import, are forgotten after the test module."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.syspath_prepend(str(EXAMPLES))
        yield lambda name: load_module(EXAMPLES / name)
    for neighbour in ('train_cifar10', 'script_checks'):
        sys.modules.pop(neighbour, None)


@pytest.fixture
def usage_error(capsys) -> Callable[[Callable[[], object]], str]:
    """``usage_error(call)``: the one line ``call`` exits with, through ``parser.error`` (exit status 2, the usage
    before it) or ``SystemExit('message')``; either way without a traceback."""
    def exit_line(call: Callable[[], object]) -> str:
        with pytest.raises(SystemExit) as exit_info:
            call()
        if exit_info.value.code == 2:
            err = capsys.readouterr().err
            assert err.startswith('usage:') and 'Traceback' not in err
            return err.strip().splitlines()[-1]
        assert isinstance(exit_info.value.code, str) and '\n' not in exit_info.value.code, exit_info.value.code
        return exit_info.value.code
    return exit_line
