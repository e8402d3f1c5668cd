"""The ``timm-hbf`` command line (pushing itself is tested against the loopback Hub in tests/hub/)."""
from importlib.metadata import entry_points

import pytest

from timm_hbf.cli import main


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


@pytest.mark.parametrize('repo_id', ['name-only', 'org/name/extra', '/name', 'org/'])
def test_push_needs_org_and_name(repo_id, capsys):
    with pytest.raises(SystemExit):
        main(['push', 'checkpoint.pth.tar', '--repo-id', repo_id])
    assert f"--repo-id: {repo_id!r} is not ORG/NAME" in capsys.readouterr().err
