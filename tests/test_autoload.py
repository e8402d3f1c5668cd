"""``import timm`` registers our models in any process once timm-hbf is installed (timm_hbf/_autoload.py).

The package is installed into throwaway virtual environments, as a wheel and editable (``pip install --no-deps
--no-build-isolation``: built with this environment's hatchling, so without the package index); they see torch and
timm through a ``.pth`` naming this environment's site-packages. Every check runs in a fresh interpreter of such an
environment. Without the build backend here the tests skip naming it (on CI, ``CI`` set, they fail instead).
"""
import json
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from tests.helpers import ROOT, require_build_backend

PROBE = """
import json, sys
before = sorted(m for m in ('timm', 'timm_hbf', 'torch') if m in sys.modules)
finders = [type(f).__name__ for f in sys.meta_path].count('TimmFinder')
import timm
print(json.dumps(dict(
    before=before, finders=finders, after=[type(f).__name__ for f in sys.meta_path].count('TimmFinder'),
    model=type(timm.create_model('vit_hyperbf_tiny')).__name__, timm_hbf=sys.modules['timm_hbf'].__file__,
)))
"""


def python(env: Path, code: str, **extra_env: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter of ``env``, run outside the repository (its timm_hbf folder is not on the
    path)."""
    return subprocess.run([str(env / 'bin' / 'python'), '-c', code], cwd=env, env=dict(os.environ, **extra_env),
                          capture_output=True, text=True, timeout=120)


def install(env: Path, source: Path, editable: bool = False) -> Path:
    """``source`` (the built wheel, or the repository for an editable install) installed into a new ``env``."""
    require_build_backend('installing timm-hbf')
    venv.create(env, with_pip=False)
    site_packages = subprocess.run(
        [str(env / 'bin' / 'python'), '-c', 'import sysconfig; print(sysconfig.get_paths()["purelib"])'],
        capture_output=True, text=True, check=True).stdout.strip()
    # torch, timm and the rest from this environment; the name sorts before the .pth files of the install
    Path(site_packages, '0_parent_env.pth').write_text(sysconfig.get_paths()['purelib'] + '\n')
    cmd = [sys.executable, '-m', 'pip', '--python', str(env / 'bin' / 'python'), 'install', '--no-deps',
           '--no-build-isolation', '--quiet', *(['--editable'] if editable else []), str(source)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f'$ {" ".join(cmd)}\n{proc.stdout}{proc.stderr}'
    return env


@pytest.fixture(scope='module')
def wheel(tmp_path_factory, built_wheel) -> Path:
    return install(tmp_path_factory.mktemp('autoload') / 'wheel', built_wheel)


@pytest.fixture(scope='module')
def editable(tmp_path_factory) -> Path:
    return install(tmp_path_factory.mktemp('autoload') / 'editable', ROOT, editable=True)


@pytest.mark.parametrize('kind', ['wheel', 'editable'])
def test_import_timm_registers_the_models(request, kind):
    env = request.getfixturevalue(kind)
    proc = python(env, PROBE)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out['before'] == []  # start-up imports none of them: only the finder is installed
    assert (out['finders'], out['after']) == (1, 0)  # one finder, gone once timm is imported
    assert out['model'] == 'VisionTransformerHyperBF'
    installed_from = env if kind == 'wheel' else ROOT
    assert Path(out['timm_hbf']).is_relative_to(installed_from)


def test_an_environment_variable_turns_it_off(wheel):
    proc = python(wheel, "import timm; print(timm.is_model('vit_hyperbf_tiny'))", TIMM_HBF_NO_AUTOLOAD='1')
    assert (proc.returncode, proc.stdout.strip()) == (0, 'False')


@pytest.mark.parametrize('warnings', ['', 'error'])
def test_a_failure_in_the_hook_only_warns(wheel, tmp_path, warnings):
    """Even where warnings are errors (python -W error, PYTHONWARNINGS=error): ``import timm`` keeps working."""
    broken = tmp_path / 'timm_hbf'
    broken.mkdir()
    (broken / '__init__.py').write_text("raise RuntimeError('broken install')\n")
    proc = python(wheel, "import timm; print(timm.list_models('resnet18'), timm.is_model('vit_hyperbf_tiny'))",
                  PYTHONPATH=str(tmp_path), PYTHONWARNINGS=warnings)
    assert (proc.returncode, proc.stdout.strip()) == (0, "['resnet18'] False"), proc.stderr
    assert 'RuntimeWarning: timm_hbf could not register its models with timm (RuntimeError: broken install)' \
        in proc.stderr
    assert 'TIMM_HBF_NO_AUTOLOAD=1' in proc.stderr


def test_importing_timm_hbf_first_works(wheel):
    proc = python(wheel, "import timm_hbf, timm; print(timm.is_model('vit_hyperbf_tiny'))")  # timm_hbf imports timm
    assert (proc.returncode, proc.stdout.strip()) == (0, 'True'), proc.stderr


def test_the_wheel_carries_the_shipped_weights(wheel):
    code = """import json, timm
names = timm.list_models(module=['vit_hyperbf', 'vit_qimia'], pretrained=True)
print(json.dumps({name: timm.create_model(name, pretrained=True).pretrained_cfg['file'] for name in names}))"""
    proc = python(wheel, code, HF_HUB_OFFLINE='1')
    assert proc.returncode == 0, proc.stderr
    files = json.loads(proc.stdout)
    assert files and all(Path(file).is_relative_to(wheel) and Path(file).is_file() for file in files.values())
