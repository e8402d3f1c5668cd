"""The ``timm-hbf`` command line (pushing itself is tested against the loopback Hub in tests/hub/)."""
from importlib.metadata import entry_points

import pytest

from timm_hbf.cli import main


def test_console_script():
    (script,) = entry_points(group='console_scripts', name='timm-hbf')
    assert script.value == 'timm_hbf.cli:main'


def test_a_command_is_required_and_help_lists_push(capsys):
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2 and 'COMMAND' in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(['--help'])
    assert e.value.code == 0 and 'push' in capsys.readouterr().out


@pytest.mark.parametrize('repo_id', ['name-only', 'org/name/extra', 'org/', 'a/b c', 'org/na--me', 'org/name.git',
                                     'org/' + 'n' * 97])
def test_push_refuses_a_repo_id_that_is_not_org_and_name_before_reading_anything(repo_id, tmp_path, capsys):
    assert main(['push', str(tmp_path / 'missing.pth.tar'), '--repo-id', repo_id, '--dry-run', str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert '--repo-id' in err and repr(repo_id) in err and 'missing.pth.tar' not in err
    assert list(tmp_path.iterdir()) == []



def test_model_kwargs_need_key_equals_value(capsys):
    with pytest.raises(SystemExit) as e:
        main(['push', 'run', '--repo-id', 'org/name', '--model-kwargs', 'depth=2', 'depth'])
    assert e.value.code == 2 and '--model-kwargs' in capsys.readouterr().err
