"""timm's own tests/test_models.py, from the sdist of the timm imported here (``TIMM_HBF_TIMM_SDIST``: the archive, or
a folder holding it; else downloaded from the package index into the system temp dir, where later runs find it;
offline the tests skip saying how to provide it, on CI, ``CI`` set, they fail). ``test_models_py`` runs it in a
subprocess with ``timm_hbf`` as a pytest plugin on every model of ours; timm parametrizes its intermediates and prune
tests over its own modules only, so they are called directly for each of :data:`CODE_MODELS`."""
import importlib.util
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import warnings
from pathlib import Path
from types import ModuleType
from typing import List, Optional

import pytest
import timm
from timm.models import get_pretrained_cfg

import timm_hbf

pytestmark = [pytest.mark.slow, pytest.mark.timm_suite]

SDIST_VARIABLE = 'TIMM_HBF_TIMM_SDIST'  # a timm-VERSION.tar.gz, or a folder holding it

# Model families: timm module name == model name prefix.
FAMILIES = ['vit_hyperbf', 'vit_qimia', 'vit_attnres']
MODELS = [name for family in FAMILIES for name in timm.list_models(module=family)]

# timm's fx, intermediates and prune tests check a model's code and cost the most: they run on one 32 x 32 model of
# each code path (the small, base, 224 x 224 and SURF models are the tiny ones' code at other sizes; full AttnRes runs
# the flags of Block AttnRes with the one-entry writes of QIMIA). timm's other tests run on every model.
CODE_PATHS_ELSEWHERE = ('_small', '_base', '224', '_surf23', 'vit_attnres_tiny')
CODE_MODELS = [name for name in MODELS if not any(other in name for other in CODE_PATHS_ELSEWHERE)]
# Models with a tag whose weights are timm's own on the Hub: the tests run offline, so timm's test that loads every
# pretrained tag skips them (tests/models/test_vit_attnres.py loads those tags from a local file instead).
HUB_MODELS = sorted({name.split('.')[0] for name in timm.list_pretrained() if name.split('.')[0] in MODELS
                     and get_pretrained_cfg(name).hf_hub_id and not get_pretrained_cfg(name).file})


def _timm_sdist(version: str) -> Path:
    """Unpacked sdist of ``timm==version``, cached in the system temp dir (see the module docstring)."""
    root = Path(tempfile.gettempdir()) / 'timm_hbf-timm-sdists'
    sdist = root / f'timm-{version}'
    given = _given_sdist(version)
    if (sdist / 'tests' / 'test_models.py').is_file():
        return sdist
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        archive = given or _download_sdist(version, Path(tmp))
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, **({'filter': 'data'} if hasattr(tarfile, 'data_filter') else {}))
        unpacked = Path(tmp) / f'timm-{version}'
        if not (unpacked / 'tests' / 'test_models.py').is_file():
            pytest.fail(f'{archive} has no timm-{version}/tests/test_models.py: it is no sdist of timm {version}.',
                        pytrace=False)
        try:
            unpacked.rename(sdist)
        except OSError:  # unpacked meanwhile by a concurrent session
            pass
    return sdist


def _given_sdist(version: str) -> Optional[Path]:
    """The archive ``TIMM_HBF_TIMM_SDIST`` names for ``version``, None if the variable is not set."""
    value = os.environ.get(SDIST_VARIABLE)
    if not value:
        return None
    given, name = Path(value), f'timm-{version}.tar.gz'
    archive = given / name if given.is_dir() else given
    if archive.name != name or not archive.is_file():
        pytest.fail(f'{SDIST_VARIABLE}={value} names no {name}, the sdist of the timm imported here. Point it to '
                    f'that file, or to a folder holding it: {_download_hint(version)}', pytrace=False)
    return archive


def _download_sdist(version: str, folder: Path) -> Path:
    """The sdist of ``timm==version``, downloaded from the package index into ``folder``; skips if it cannot be
    (fails on CI, which has the index)."""
    cmd = [sys.executable, '-m', 'pip', 'download', '--no-binary', ':all:', '--no-deps', '--timeout', '30',
           '--retries', '1', f'timm=={version}', '-d', str(folder)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    archives = list(folder.glob('timm-*.tar.gz'))
    if proc.returncode == 0 and archives:
        return archives[0]
    last_line = (proc.stdout.strip().splitlines() or ['no output'])[-1]
    reason = (f"timm's test suite needs the sdist of timm {version}, which {SDIST_VARIABLE} does not name and the "
              f'package index did not give ($ {" ".join(cmd)}: {last_line}). {_download_hint(version)}')
    if os.environ.get('CI'):
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)


def _download_hint(version: str) -> str:
    return (f'Where the index is reachable: pip download --no-binary :all: --no-deps timm=={version} -d DIR, then set '
            f'{SDIST_VARIABLE}=DIR.')


@pytest.fixture(scope='session')
def timm_sdist() -> Path:
    """Root of the unpacked sdist of the imported timm version."""
    return _timm_sdist(timm.__version__)


@pytest.fixture(scope='session')
def timm_test_models(timm_sdist: Path):
    """The sdist's ``tests/test_models.py``, imported under a name pytest does not collect."""
    tests_dir = str(timm_sdist / 'tests')
    sys.path.insert(0, tests_dir)
    name = 'timm_sdist_test_models'
    spec = importlib.util.spec_from_file_location(name, timm_sdist / 'tests' / 'test_models.py')
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        with warnings.catch_warnings():  # timm's markers are declared in its config, not ours
            warnings.simplefilter('ignore', pytest.PytestUnknownMarkWarning)
            spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)
        sys.path.remove(tests_dir)


def _timm_test(module: ModuleType, name: str):
    fn = getattr(module, name, None)
    if fn is None:
        pytest.skip(f'timm {timm.__version__} has no {name}')
    return fn


def _selection(models: List[str]) -> str:
    """pytest's ``-k`` expression for timm's tests of ``models``: every test, the fx ones of :data:`CODE_MODELS` only,
    no loading of :data:`HUB_MODELS`' weights. Names match as substrings, so an fx test, whose id ends in its model's
    name (``test_model_forward_fx[1-NAME]``), is named with the bracket."""
    fx_models = ' or '.join(f'{name}]' for name in models if name in CODE_MODELS)
    hub_models = ' or '.join(f'{name}.' for name in models if name in HUB_MODELS)
    return (f'({" or ".join(models)}) and (not fx or {fx_models or "no_model"})'
            f' and not (load_pretrained and ({hub_models or "no_model"}))')


def test_models_py(timm_sdist: Path, tmp_path: Path):
    """timm's tests/test_models.py on every model of ours: each passes timm's forward and backward tests, the models
    of :data:`CODE_MODELS` its fx tests too, and no test fails."""
    env = dict(os.environ)
    # the timm_hbf imported here, after whatever PYTHONPATH selects (e.g. another timm)
    env['PYTHONPATH'] = os.pathsep.join(
        p for p in (env.get('PYTHONPATH'), str(Path(timm_hbf.__file__).parents[1])) if p)
    cmd = [
        sys.executable, '-m', 'pytest', '-p', 'timm_hbf', str(timm_sdist / 'tests' / 'test_models.py'),
        '--rootdir', str(timm_sdist), '--import-mode=importlib', '-p', 'no:cacheprovider',
        '-k', _selection(MODELS), '-v', '-rfE', '--tb=short', '--color=no',
    ]
    # cwd outside the sdist root: there its timm/ package would shadow the installed one
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rc, output = proc.returncode, proc.stdout
    first_error = [line for line in output.splitlines() if line.startswith('E ')][:30]
    report = '\n'.join([f'$ {" ".join(cmd)}', 'first error:', *first_error, 'output tail:', output[-5000:]])
    assert rc == 0, report  # no test failed
    passed = set(re.findall(r'::(\w+)\[\d+-([\w.]+)\] PASSED', output))
    expected = {(test, model) for model in MODELS for test in ('test_model_forward', 'test_model_backward')}
    expected |= {(test, model) for model in CODE_MODELS
                 for test in ('test_model_forward_fx', 'test_model_backward_fx')}
    assert not expected - passed, f'did not pass: {sorted(expected - passed)}\n{report}'


@pytest.mark.parametrize('model_name', CODE_MODELS)
def test_forward_intermediates(model_name: str, timm_test_models: ModuleType):
    _timm_test(timm_test_models, 'test_model_forward_intermediates')(model_name, batch_size=1)


@pytest.mark.parametrize('model_name', CODE_MODELS)
def test_forward_intermediates_features(model_name: str, timm_test_models: ModuleType):
    _timm_test(timm_test_models, 'test_model_forward_intermediates_features')(model_name, batch_size=1)


@pytest.mark.parametrize('model_name', CODE_MODELS)
def test_prune_intermediate_layers_contract(model_name: str, timm_test_models: ModuleType):
    _timm_test(timm_test_models, 'test_prune_intermediate_layers_contract')(model_name)
