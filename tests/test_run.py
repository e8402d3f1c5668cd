"""``python -m timm_hbf.run SCRIPT ARGS...``: any of timm's scripts, with our models registered."""
import json
import os
import subprocess
import sys

import pytest

from timm_hbf import run

SCRIPT = """
import json, sys
import helper  # a module beside the script, as timm's scripts may import
import timm
print(json.dumps(dict(name=__name__, argv=sys.argv, registered=timm.is_model('vit_hyperbf_tiny'), helper=helper.X)))
sys.exit(3)
"""


def test_runs_the_script_as_main_with_its_arguments_and_the_models(tmp_path):
    script = tmp_path / 'scripts' / 'train.py'
    script.parent.mkdir()
    script.write_text(SCRIPT)
    (script.parent / 'helper.py').write_text('X = 42\n')
    env = dict(os.environ, TIMM_HBF_NO_AUTOLOAD='1')  # the models come from timm_hbf.run alone
    proc = subprocess.run([sys.executable, '-m', 'timm_hbf.run', str(script), '--model', 'vit_hyperbf_tiny', '-b', '8'],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr  # the script's exit status
    assert json.loads(proc.stdout) == dict(
        name='__main__', argv=[str(script), '--model', 'vit_hyperbf_tiny', '-b', '8'], registered=True, helper=42)


def test_a_missing_script_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="no script at 'train.py'") as e:
        run.main(['train.py', '--model', 'vit_hyperbf_tiny'])
    assert 'git clone https://github.com/huggingface/pytorch-image-models' in str(e.value)


@pytest.mark.parametrize('script', ['last.pth.tar', 'weights.pth', 'train', '--model'])
def test_a_script_that_is_no_python_file_is_refused_before_it_runs(tmp_path, monkeypatch, script):
    """A checkpoint or a text file named first would run as Python (or as a zip archive, without __main__)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'last.pth.tar').write_text('model: vit_hyperbf_tiny\n')
    (tmp_path / 'weights.pth').write_bytes(b'PK\x03\x04' + bytes(100))
    with pytest.raises(SystemExit) as e:
        run.main([script, 'train.py'])
    assert str(e.value) == (
        f'timm_hbf.run: SCRIPT must be a Python file such as train.py, got {script!r}. The script comes first, its '
        'arguments after it: python -m timm_hbf.run SCRIPT [ARGS...]')


def test_a_folder_as_script_says_to_name_the_script_in_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'pytorch-image-models').mkdir()
    with pytest.raises(SystemExit) as e:
        run.main(['pytorch-image-models', '--model', 'vit_hyperbf_tiny'])
    assert str(e.value) == (
        "timm_hbf.run: SCRIPT must be a Python file such as train.py, got 'pytorch-image-models', a folder: name the "
        'script in it, e.g. python -m timm_hbf.run pytorch-image-models/train.py ...')


def test_the_legacy_launchers_local_rank_first_says_to_use_torchrun():
    with pytest.raises(SystemExit, match=r'got --local-rank=0 where the script goes.*Launch with torchrun'):
        run.main(['--local-rank=0', 'train.py', '--model', 'vit_hyperbf_tiny'])


def test_usage(capsys):
    with pytest.raises(SystemExit) as e:
        run.main([])
    assert e.value.code == 2 and capsys.readouterr().err.startswith('usage: python -m timm_hbf.run SCRIPT')
    with pytest.raises(SystemExit) as e:
        run.main(['--help'])
    assert e.value.code == 0 and 'torchrun' in capsys.readouterr().out
