"""``timm-hbf push`` against the loopback Hub and with ``--dry-run``, and ``timm.create_model('hf-hub:...')`` of what
it pushed."""
import hashlib
import json
import shutil
import socket
import time

import pytest
import safetensors.torch
import timm
import torch
import yaml
from huggingface_hub import constants
from safetensors.torch import load_file, save_file
from timm.data import ImageDataset, create_transform, resolve_data_config, resolve_model_data_config

from timm_hbf.cli import main

from .conftest import CIFAR10_LABELS, HYPERBF, assert_same_tensors, load_checkpoint, train_like_train_py

# huggingface_hub's LFS upload passes bytes as data=, which its HTTP library deprecates: not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>' to upload raw bytes:DeprecationWarning")

PUSHED_FILES = {'.gitattributes', 'README.md', 'config.json', 'model.safetensors', 'training_curves.png'}


def push(*args) -> int:
    return main(['push', *map(str, args)])


def local(folder) -> torch.nn.Module:
    return timm.create_model(f'local-dir:{folder}', pretrained=True).eval()


def test_push_then_pull_gives_the_checkpoint_s_logits_and_reloads_offline(hub, train_run, cifar10_sample, monkeypatch,
                                                                          capsys):
    assert push(train_run, '--repo-id', 'push/e2e') == 0
    commit = hub.repos['push/e2e'].refs['main']
    out = capsys.readouterr().out
    assert f'/push/e2e/commit/{commit}' in out and f"'hf-hub:push/e2e@{commit}'" in out
    assert set(hub.files('push/e2e')) == PUSHED_FILES
    weights = hashlib.sha256(hub.files('push/e2e')['model.safetensors']).hexdigest()
    assert ('PUT', f'/_lfs/{weights}', 200) in hub.requests  # by LFS

    def logits(model, data_config):  # on CIFAR-10 test images
        images = ImageDataset(str(cifar10_sample / 'test'), transform=create_transform(**data_config))
        with torch.no_grad():
            return model(torch.stack([images[i][0] for i in range(0, len(images), 10)]))

    # the checkpoint's weights with train.py's evaluation preprocessing (crop_pct), computed without timm_hbf.hub
    args = yaml.safe_load((train_run / 'args.yaml').read_text())
    trained = timm.create_model(HYPERBF, num_classes=10, **args['model_kwargs']).eval()
    trained.load_state_dict(load_checkpoint(train_run / 'model_best.pth.tar')['state_dict'])
    pulled = timm.create_model('hf-hub:push/e2e', pretrained=True).eval()
    assert torch.equal(logits(pulled, resolve_model_data_config(pulled)),
                       logits(trained, resolve_data_config(args, model=trained)))
    assert pulled.pretrained_cfg['hf_hub_id'] == 'push/e2e'

    hub.requests.clear()
    monkeypatch.setattr(constants, 'HF_HUB_OFFLINE', True)
    assert_same_tensors(timm.create_model('hf-hub:push/e2e', pretrained=True).state_dict(), trained.state_dict())
    assert hub.requests == []


def test_dry_run_writes_what_push_pushes_without_a_request(hub, train_run, tmp_path, capsys):
    assert push(train_run, '--repo-id', 'push/dry', '--dry-run', tmp_path / 'dry') == 0
    assert hub.requests == [] and 'nothing was pushed' in capsys.readouterr().out
    assert push(train_run, '--repo-id', 'push/dry') == 0
    files = {path: data for path, data in hub.files('push/dry').items() if path != '.gitattributes'}
    assert {p.name: p.read_bytes() for p in (tmp_path / 'dry').iterdir()} == files
    # class names only from --label-names: the registry's are those of its own weights
    assert timm.create_model(HYPERBF).pretrained_cfg['label_names']
    config = json.loads(files['config.json'])
    assert 'label_names' not in config and 'label_names' not in config['pretrained_cfg']


@pytest.mark.parametrize('option', ['--private --revision dev --pytorch-bin', '--create-pr'])
def test_repo_options(hub, train_run, capsys, option):
    repo = 'push/' + option.split()[0].strip('-')
    assert push(train_run, '--repo-id', repo, *option.split()) == 0
    assert set(hub.files(repo)) == {'.gitattributes'}  # main unchanged
    if option == '--create-pr':
        assert f'{hub.endpoint}/{repo}/discussions/1' in capsys.readouterr().out
        assert set(hub.files(repo, 'refs/pr/1')) == PUSHED_FILES
    else:
        assert hub.repos[repo].private and set(hub.files(repo, 'dev')) == PUSHED_FILES | {'pytorch_model.bin'}


def test_ema_weights_and_label_names_from_a_file(train_run, tmp_path):
    (tmp_path / 'args.txt').write_text('--label-names\n' + '\n'.join(CIFAR10_LABELS))
    assert push(train_run, '--repo-id', 'push/ema', '--ema', f'@{tmp_path / "args.txt"}', '--dry-run',
                tmp_path / 'dry') == 0
    assert_same_tensors(load_file(tmp_path / 'dry' / 'model.safetensors'),
                        load_checkpoint(train_run / 'model_best.pth.tar')['state_dict_ema'])
    assert local(tmp_path / 'dry').pretrained_cfg['label_names'] == CIFAR10_LABELS


def test_bfloat16_weights_but_the_kernel_widths_load_into_float32(train_run, tmp_path):
    assert push(train_run, '--repo-id', 'push/bf16', '--dtype', 'bfloat16', '--dry-run', tmp_path / 'dry') == 0
    weights, exact = load_file(tmp_path / 'dry' / 'model.safetensors'), load_checkpoint(
        train_run / 'model_best.pth.tar')['state_dict']
    widths = {k for k in weights if k.endswith('.log_gamma')}
    assert widths and all(weights[k].dtype == (torch.float32 if k in widths else torch.bfloat16) for k in weights)
    assert all(torch.equal(weights[k], exact[k]) for k in widths)  # not rounded
    state = local(tmp_path / 'dry').state_dict()
    assert all(state[k].dtype == torch.float32 and torch.equal(state[k], w.float()) for k, w in weights.items())


def test_a_run_of_train_py_gp_avg_loads_back_pooling_so(tmp_path):
    run = train_like_train_py(tmp_path / 'avg', epochs=1, gp='avg')
    assert push(run, '--repo-id', 'push/avg', '--dry-run', tmp_path / 'dry') == 0
    pushed = local(tmp_path / 'dry')
    assert pushed.global_pool == 'avg'
    assert_same_tensors(pushed.state_dict(), load_checkpoint(run / 'last.pth.tar')['state_dict'])


@pytest.mark.parametrize('model_kwargs, input_size, fixed', [
    (dict(img_size=48), (3, 48, 48), True),
    (dict(in_chans=1), (1, 32, 32), True),
    (dict(dynamic_img_size=True), (3, 32, 32), False),
    (dict(patch_size=8, num_classes=3, kernel='laplacian'), (3, 32, 32), True),  # the kernel changes no shape
])
def test_a_bare_state_dict_with_model_and_model_kwargs_is_pushed_with_its_input_and_computes_as_trained(
        tmp_path, model_kwargs, input_size, fixed):
    """--model-kwargs gives what the weights do not, values read as timm reads them; torch.save's or safetensors'."""
    trained = timm.create_model(HYPERBF, depth=1, **model_kwargs).eval()
    weights = tmp_path / ('weights.safetensors' if 'kernel' in model_kwargs else 'weights.pth')
    (save_file if weights.suffix == '.safetensors' else torch.save)(trained.state_dict(), weights)
    kwargs = [f'{k}={v}' for k, v in model_kwargs.items() if k not in ('in_chans', 'num_classes')]  # in the weights
    assert push(weights, '--repo-id', 'push/input', '--model', HYPERBF, '--model-kwargs', 'depth=1',
                *kwargs, '--dry-run', tmp_path / 'dry') == 0
    pushed = local(tmp_path / 'dry')
    cfg = pushed.pretrained_cfg
    assert (tuple(cfg['input_size']), cfg['fixed_input_size'], len(cfg['mean'])) == (input_size, fixed, input_size[0])
    assert f'{input_size[1]} x {input_size[2]}' in (tmp_path / 'dry' / 'README.md').read_text()
    x = torch.randn(2, *input_size)
    with torch.no_grad():
        assert torch.equal(pushed(x), trained(x))


# --- failures: one line naming the fix, nothing half written --------------------------------------------------------

def failed(capsys, *args) -> str:
    """The error of ``timm-hbf push ARGS``, which must fail with one line (after the upload's progress bars)."""
    assert push(*args) == 1
    err = capsys.readouterr().err
    assert err.count('error: ') == 1 and err.splitlines()[-1].startswith('error: '), err
    return err.splitlines()[-1]


@pytest.mark.parametrize('login', ['no token', 'refused token', '403 on commit'])
def test_a_push_without_write_access_says_to_log_in(hub, train_run, monkeypatch, capsys, login):
    repo = f'org-{login.replace(" ", "-")}/model'
    if login == 'no token':
        monkeypatch.delenv('HF_TOKEN')
    elif login == 'refused token':
        monkeypatch.setenv('HF_TOKEN', 'hf_wrong')
    else:
        hub.fail('POST', f'/api/models/{repo}/commit/main', 403)
    err = failed(capsys, train_run, '--repo-id', repo)
    assert all(name in err for name in (repo, '40', 'hf auth login', 'HF_TOKEN', repo.split('/')[0]))
    assert repo not in hub.repos or set(hub.files(repo)) == {'.gitattributes'}


def test_a_hub_that_fails_names_the_status(hub, train_run, monkeypatch, capsys):
    monkeypatch.setattr(time, 'sleep', lambda seconds: None)  # the client retries, backing off
    hub.fail('POST', '/api/models/*/commit/*', 500, times=20)
    assert all(name in failed(capsys, train_run, '--repo-id', 'push/500') for name in (hub.endpoint, '500'))
    assert set(hub.files('push/500')) == {'.gitattributes'}


def test_no_answer_names_the_endpoint(hub, train_run, monkeypatch, capsys):
    monkeypatch.setattr(time, 'sleep', lambda seconds: None)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(('127.0.0.1', 0))
        monkeypatch.setattr(constants, 'ENDPOINT', f'http://127.0.0.1:{s.getsockname()[1]}')
        err = failed(capsys, train_run, '--repo-id', 'push/nowhere')
    assert constants.ENDPOINT in err and 'HF_ENDPOINT' in err


def test_hf_hub_offline_says_to_unset_it_or_dry_run(hub, train_run, monkeypatch, capsys):
    monkeypatch.setattr(constants, 'HF_HUB_OFFLINE', True)
    err = failed(capsys, train_run, '--repo-id', 'push/offline')
    assert 'HF_HUB_OFFLINE' in err and '--dry-run' in err and hub.requests == []


def damage(run, tmp_path, case: str):
    """A copy of ``run`` with ``case`` wrong; what to push and the options."""
    run = shutil.copytree(run, tmp_path / 'run')
    last = (run / 'last.pth.tar').read_bytes()
    if case in ('truncated', 'empty'):
        (run / 'last.pth.tar').write_bytes(last[:-1000] if case == 'truncated' else b'')
        return run / 'last.pth.tar', []
    if case == 'no checkpoint':
        return tmp_path, []
    if case == 'bare state dict --ema':
        torch.save(load_checkpoint(run / 'last.pth.tar')['state_dict'], run / 'weights.pth')
        return run / 'weights.pth', ['--ema']
    if case == 'args.yaml':
        (run / 'args.yaml').write_text('model: [vit_hyperbf_tiny\n')
    if case == 'summary.csv':
        summary = (run / 'summary.csv').read_text()
        (run / 'summary.csv').write_text(summary[:summary.rindex(',')])  # the last row cut short
    return run, {'other architecture': ['--model', 'vit_qimia_tiny'], 'unknown': ['--model', 'not_a_model'],
                 'bogus': ['--model-kwargs', 'depth=2', 'bogus=3'], 'labels': ['--label-names', 'a', 'b', 'c']
                 }.get(case, [])


@pytest.mark.parametrize('case, names', [
    ('truncated', ['last.pth.tar']),
    ('empty', ['last.pth.tar']),
    ('no checkpoint', ['model_best.pth.tar', 'last.pth.tar']),
    ('bare state dict --ema', ['weights.pth', '--model-ema']),
    ('other architecture', ['vit_qimia_tiny', '--model', '--model-kwargs']),
    ('bogus', ['bogus', '--model-kwargs']),
    ('unknown', ['not_a_model', '--model']),
    ('labels', ['--label-names', '3', '10']),
    ('args.yaml', ['args.yaml']),
    ('summary.csv', ['summary.csv', 'line 4']),
])
def test_bad_input_is_named_before_any_request(hub, train_run, tmp_path, capsys, case, names):
    checkpoint, options = damage(train_run, tmp_path, case)
    err = failed(capsys, checkpoint, '--repo-id', 'push/bad', *options)
    assert [name for name in names if name not in err] == []
    assert hub.requests == [] and 'push/bad' not in hub.repos


@pytest.mark.parametrize('target', ['existing folder', 'under a file', 'full disk'])
def test_a_dry_run_that_cannot_write_leaves_everything_as_it_was(train_run, tmp_path, monkeypatch, capsys, target):
    (tmp_path / 'notes').write_text('mine')
    folder = tmp_path / {'existing folder': '.', 'under a file': 'notes/dry', 'full disk': 'dry'}[target]
    if target == 'full disk':
        def full(*args, **kwargs):
            raise OSError(28, 'No space left on device')
        monkeypatch.setattr(safetensors.torch, 'save_file', full)
    err = failed(capsys, train_run, '--repo-id', 'push/nowhere', '--dry-run', folder)
    assert str(folder) in err
    assert [p.name for p in tmp_path.iterdir()] == ['notes'] and (tmp_path / 'notes').read_text() == 'mine'
