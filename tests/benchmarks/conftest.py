"""The benchmark scripts import one another by file name (``from throughput import check_counts``), as they do when
run from their folder: that folder is on ``sys.path`` while these tests run."""
import sys

import pytest

from tests.helpers import ROOT


@pytest.fixture(scope='package', autouse=True)
def benchmarks_on_path():
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.syspath_prepend(str(ROOT / 'benchmarks'))
        yield
    sys.modules.pop('throughput', None)
