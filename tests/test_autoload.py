"""``import timm`` registers our models in any process once timm-hbf is installed (timm_hbf/_autoload.py): checked in
fresh interpreters of throwaway environments with the wheel or an editable install (:func:`tests.helpers.install`)."""
import json
import subprocess
from pathlib import Path

import pytest

from tests.helpers import ROOT, install, run_in

pytestmark = pytest.mark.slow  # builds and installs the package twice

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
    return run_in(env, 'python', '-c', code, cwd=env, **extra_env)


@pytest.fixture(scope='module')
def editable(tmp_path_factory) -> Path:
    return install(tmp_path_factory.mktemp('autoload') / 'editable', ROOT, editable=True)


@pytest.mark.parametrize('kind', ['wheel_env', 'editable'])
def test_import_timm_registers_the_models(request, kind):
    env = request.getfixturevalue(kind)
    proc = python(env, PROBE)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out['before'] == []  # start-up imports none of them: only the finder is installed
    assert (out['finders'], out['after']) == (1, 0)  # one finder, gone once timm is imported
    assert out['model'] == 'VisionTransformerHyperBF'
    installed_from = env if kind == 'wheel_env' else ROOT
    assert Path(out['timm_hbf']).is_relative_to(installed_from)


def test_an_environment_variable_turns_it_off_and_timm_alone_has_none_of_our_names(wheel_env):
    code = "import timm; print(timm.list_models(['vit_hyperbf*', 'vit_qimia*', 'vit_attnres*']))"
    proc = python(wheel_env, code, TIMM_HBF_NO_AUTOLOAD='1')
    assert (proc.returncode, proc.stdout.strip()) == (0, '[]')


@pytest.mark.parametrize('warnings', ['', 'error'])
def test_a_failure_in_the_hook_only_warns(wheel_env, tmp_path, warnings):
    """Even where warnings are errors (python -W error, PYTHONWARNINGS=error): ``import timm`` keeps working."""
    broken = tmp_path / 'timm_hbf'
    broken.mkdir()
    (broken / '__init__.py').write_text("raise RuntimeError('broken install')\n")
    proc = python(wheel_env, "import timm; print(timm.list_models('resnet18'), timm.is_model('vit_hyperbf_tiny'))",
                  PYTHONPATH=str(tmp_path), PYTHONWARNINGS=warnings)
    assert (proc.returncode, proc.stdout.strip()) == (0, "['resnet18'] False"), proc.stderr
    assert 'RuntimeWarning: timm_hbf could not register its models with timm (RuntimeError: broken install)' \
        in proc.stderr
    assert 'TIMM_HBF_NO_AUTOLOAD=1' in proc.stderr


def test_importing_timm_hbf_first_works(wheel_env):
    proc = python(wheel_env, "import timm_hbf, timm; print(timm.is_model('vit_hyperbf_tiny'))")  # timm_hbf imports timm
    assert (proc.returncode, proc.stdout.strip()) == (0, 'True'), proc.stderr

