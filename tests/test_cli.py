"""The ``timm-hbf`` command line (pushing itself is tested against the loopback Hub in tests/hub/)."""
import argparse
from importlib.metadata import entry_points

import pytest

from timm_hbf.cli import ParseKwargs, main


def test_console_script():
    (script,) = entry_points(group='console_scripts', name='timm-hbf')
    assert script.value == 'timm_hbf.cli:main'


def test_a_command_is_required(capsys):
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2 and 'the following arguments are required: COMMAND' in capsys.readouterr().err


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as e:
        main(['--help'])
    assert e.value.code == 0
    assert 'push      push a train.py checkpoint to the Hugging Face Hub' in capsys.readouterr().out


@pytest.mark.parametrize('repo_id', ['name-only', 'org/name/extra', '/name', 'org/', 'a/b c', '../..', 'org/-name',
                                     'org/na--me', 'org/name.git', 'org/' + 'n' * 97])
def test_push_needs_a_repo_id_of_org_and_name_before_reading_anything(repo_id, tmp_path, capsys):
    """Refused as the arguments are parsed: neither the checkpoint (missing here) nor the dry-run folder is touched."""
    with pytest.raises(SystemExit) as e:
        main(['push', str(tmp_path / 'missing.pth.tar'), '--repo-id', repo_id, '--dry-run', str(tmp_path / 'dry')])
    assert e.value.code == 2 and capsys.readouterr().err.endswith(
        "error: argument --repo-id: repo_id must be ORG/NAME: names of letters, digits, '-', '_' and '.', neither "
        "starting nor ending with '-' or '.', without '--' or '..', at most 96 characters each, NAME not ending in "
        f"'.git', got {repo_id!r}.\n")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize('item', ['depth', '=2'])
def test_model_kwargs_need_key_equals_value(item, capsys):
    with pytest.raises(SystemExit) as e:
        main(['push', 'checkpoint.pth.tar', '--repo-id', 'org/name', '--model-kwargs', 'img_size=32', item])
    assert e.value.code == 2 and capsys.readouterr().err.endswith(
        f'error: argument --model-kwargs: takes KEY=VALUE items, got {item!r}\n')


def test_parse_kwargs_reads_values_as_timm_s_does():
    """Python literals, else strings; no items, no arguments. For any script's --model-kwargs."""
    parser = argparse.ArgumentParser()
    parser.add_argument('--model-kwargs', nargs='*', default={}, action=ParseKwargs)
    assert parser.parse_args([]).model_kwargs == {}
    assert parser.parse_args(['--model-kwargs']).model_kwargs == {}
    assert parser.parse_args(['--model-kwargs', 'depth=2', 'kernel=laplacian', 'img_size=(32, 48)', 'eps=1e-6',
                              'act=a=b']).model_kwargs == dict(depth=2, kernel='laplacian', img_size=(32, 48),
                                                               eps=1e-6, act='a=b')
