"""The README's code runs as written: its quick start (with an image and a checkpoint of one's own where it names
them) and its Python one-liners."""
import re
import shlex

import timm
import torch

from tests.helpers import ROOT

CHECKPOINT = 'output/train/.../last.pth.tar'  # the README's stand-in for a train.py run's checkpoint
IMAGE = 'cat.jpg'  # its stand-in for an image of one's own
README = (ROOT / 'README.md').read_text()


def code_block(section: str, language: str) -> str:
    """The first ``language`` code block of the README section titled ``section``."""
    found = re.search(rf'^## {section}\n.*?^```{language}\n(.*?)^```', README, flags=re.M | re.S)
    assert found, f'README.md has no {language} block under "## {section}"'
    return found[1]


def test_the_setup_commands_come_first_and_name_the_main_job_and_the_tests():
    first = re.search(r'^```bash\n(.*?)^```', README, flags=re.M | re.S)[1].splitlines()
    assert first == [
        'python3 -m venv .venv && .venv/bin/pip install -e ".[demo]" && .venv/bin/python examples/classify_cifar10.py',
        'python3 -m venv .venv && .venv/bin/pip install -e ".[test]" && .venv/bin/python -m pytest',
    ]
    assert (ROOT / 'examples' / 'classify_cifar10.py').is_file()


def test_the_quick_start_runs_with_ones_own_image_and_checkpoint(tmp_path, cifar10_sample, capsys, monkeypatch):
    code = code_block('Quick start', 'python')
    assert CHECKPOINT in code and f"'{IMAGE}'" in code
    trained = timm.create_model('vit_qimia_tiny', num_classes=10)
    checkpoint = tmp_path / 'last.pth.tar'
    torch.save({'epoch': 0, 'arch': 'vit_qimia_tiny', 'state_dict': trained.state_dict()}, checkpoint)
    image = sorted((cifar10_sample / 'test' / 'cat').iterdir())[0]
    monkeypatch.setenv('HF_HUB_OFFLINE', '1')  # the shipped weights load without a network
    scope = {}
    code = code.replace(CHECKPOINT, str(checkpoint)).replace(f"'{IMAGE}'", repr(str(image)))
    exec(compile(code, 'README.md: Quick start', 'exec'), scope)

    architectures, shipped, label, *rest = capsys.readouterr().out.splitlines()
    assert not rest
    for family in ('vit_hyperbf', 'vit_qimia', 'vit_attnres'):
        assert f"'{family}_tiny'" in architectures, family
    assert eval(shipped) == timm.list_models(module=['vit_hyperbf', 'vit_qimia', 'vit_attnres'], pretrained=True)
    assert label in scope['model'].pretrained_cfg['label_names']
    features = scope['features'](torch.randn(1, 3, 32, 32))
    assert [f.shape for f in features] == [torch.Size([1, 192, 8, 8])] * 3
    for key, value in trained.state_dict().items():
        assert torch.equal(scope['mine'].state_dict()[key], value), key


def test_the_hub_commands_push_a_train_py_run_and_name_the_repo_timm_pulls(tmp_path, monkeypatch):
    """The push command as written, on a train.py output folder, with ``--dry-run`` (nothing leaves the machine); the
    folder it writes loads with timm, and the pull command names the pushed repo in timm's ``hf-hub:`` form."""
    from timm_hbf.cli import main

    lines = code_block('The Hugging Face Hub', 'bash').replace('\\\n', ' ').splitlines()
    push, pull = (shlex.split(line, comments=True) for line in lines)
    assert push[:2] == ['timm-hbf', 'push'] and pull[:2] == ['python', '-c']
    repo = push[push.index('--repo-id') + 1]
    assert f"'hf-hub:{repo}'" in pull[2]
    run = tmp_path / push[2]
    run.mkdir(parents=True)
    model = timm.create_model('vit_attnres_tiny', depth=1)
    torch.save({'epoch': 0, 'arch': 'vit_attnres_tiny', 'state_dict': model.state_dict()}, run / 'last.pth.tar')
    (run / 'args.yaml').write_text('model: vit_attnres_tiny\nmodel_kwargs:\n  depth: 1\n')
    monkeypatch.chdir(tmp_path)
    assert main([*push[1:], '--dry-run', 'repo']) == 0
    exec(pull[2].replace(f'hf-hub:{repo}', f'local-dir:{tmp_path / "repo"}'), {})  # the pull, from the folder
    pushed = timm.create_model(f'local-dir:{tmp_path / "repo"}', pretrained=True)
    assert pushed.pretrained_cfg['label_names'] == push[push.index('--label-names') + 1:]
    for key, value in model.state_dict().items():
        assert torch.equal(pushed.state_dict()[key], value), key
