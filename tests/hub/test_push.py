"""``timm-hbf push`` against the loopback Hub, and the pull of what it pushed with ``timm.create_model('hf-hub:...')``,
each in a fresh process with its own HF_HOME."""
import errno
import hashlib
import json
import os
import re
import shutil
import socket
from pathlib import Path

import pytest
import safetensors.torch
import timm
import torch
import yaml
from huggingface_hub import HfApi, constants, snapshot_download
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from timm.data import ImageDataset, create_transform, resolve_data_config

from timm_hbf.cli import main
from timm_hbf.hub import HubError, push, push_to_hub, read_train_output, write_repo_folder

from .conftest import CIFAR10_LABELS, HYPERBF, TOKEN, assert_same_tensors, load_checkpoint, run_pull, run_push

# huggingface_hub's LFS upload passes bytes as data=, which its HTTP library deprecates: not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>' to upload raw bytes:DeprecationWarning")

PUSHED_FILES = {'.gitattributes', 'README.md', 'config.json', 'model.safetensors', 'training_curves.png'}


def reference_logits(train_run, images, weights: str = 'state_dict'):
    """The logits of the checkpoint's weights on ``images``, preprocessed as train.py evaluated them, computed here
    without timm_hbf.hub; and the weights."""
    checkpoint = load_checkpoint(train_run / 'model_best.pth.tar')
    args = yaml.safe_load((train_run / 'args.yaml').read_text())
    model = timm.create_model(args['model'], num_classes=args['num_classes'], **args['model_kwargs']).eval()
    model.load_state_dict(checkpoint[weights])
    dataset = ImageDataset(str(images), transform=create_transform(**resolve_data_config(args, model=model)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same reduction order as the pulling process
    try:
        with torch.no_grad():
            return model(torch.stack([dataset[i][0] for i in range(len(dataset))])), checkpoint[weights]
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_push_then_pull_over_lfs_gives_identical_logits(fresh_hub, train_run, cifar10_sample, tmp_path):
    repo = 'push/hbf-lfs'
    proc = run_push(fresh_hub, tmp_path / 'push-home', [str(train_run), '--repo-id', repo], HF_HUB_DISABLE_XET='1')
    assert proc.returncode == 0, proc.stderr
    commit = fresh_hub.repos[repo].refs['main']
    assert f'/{repo}/commit/{commit}' in proc.stdout and f"'hf-hub:{repo}@{commit}'" in proc.stdout
    files = fresh_hub.files(repo)
    assert set(files) == PUSHED_FILES  # safetensors only
    weights = hashlib.sha256(files['model.safetensors']).hexdigest()
    # An LFS object the Hub holds already is not sent again: the weights may be there from other tests, the curves
    # (titled with the repo id) are not.
    curves = hashlib.sha256(files['training_curves.png']).hexdigest()
    requests = [(r.method, r.path, r.status) for r in fresh_hub.requests]
    for request in [
        ('POST', '/api/repos/create', 200),
        ('POST', '/api/models/push/hbf-lfs/preupload/main', 200),
        ('POST', '/push/hbf-lfs.git/info/lfs/objects/batch', 200),
        ('PUT', f'/_lfs/{curves}', 200),
        ('POST', f'/_lfs/{curves}/verify', 200),
        ('POST', '/api/models/push/hbf-lfs/commit/main', 200),
    ]:
        assert request in requests
    assert fresh_hub.repos[repo].commits[commit]['model.safetensors'].lfs

    fresh_hub.requests.clear()
    images = cifar10_sample / 'test'
    pulled = run_pull(fresh_hub, tmp_path / 'pull-home', f'hf-hub:{repo}', images, tmp_path / 'pulled.pt')
    requests = [(r.method, r.path, r.status) for r in fresh_hub.requests]
    assert ('HEAD', f'/{repo}/resolve/main/model.safetensors', 302) in requests  # redirected to the CDN
    assert ('GET', f'/_cdn/{weights}', 200) in requests
    logits, state_dict = reference_logits(train_run, images)
    assert pulled['logits'].shape == (200, 10) and torch.equal(pulled['logits'], logits)
    assert_same_tensors(pulled['state_dict'], state_dict)
    assert pulled['pretrained_cfg']['hf_hub_id'] == repo

    fresh_hub.requests.clear()
    again = run_pull(fresh_hub, tmp_path / 'pull-home', f'hf-hub:{repo}', images, tmp_path / 'again.pt',
                     HF_HUB_OFFLINE='1')
    assert fresh_hub.requests == []
    assert torch.equal(again['logits'], logits)


@pytest.mark.slow
def test_push_ema_then_pull_pinned_commit_over_regular_upload(fresh_hub, train_run, cifar10_sample, tmp_path):
    """The client's defaults (Xet enabled), with a Hub that takes every file in the commit itself."""
    repo = 'push/hbf-regular'
    fresh_hub.upload_mode = 'regular'
    args = [str(train_run / 'model_best.pth.tar'), '--repo-id', repo, '--ema', '--label-names', *CIFAR10_LABELS]
    proc = run_push(fresh_hub, tmp_path / 'push-home', args)
    assert proc.returncode == 0, proc.stderr
    commit = fresh_hub.repos[repo].refs['main']
    paths = [r.path for r in fresh_hub.requests]
    assert f'/api/models/{repo}/preupload/main' in paths and f'/api/models/{repo}/commit/main' in paths
    assert not [p for p in paths if 'lfs' in p or 'xet' in p]
    assert not any(blob.lfs for blob in fresh_hub.repos[repo].commits[commit].values())

    fresh_hub.publish(repo, {'README.md': b'a later commit'})  # the pinned commit is no longer the head of main
    images = cifar10_sample / 'test'
    pulled = run_pull(fresh_hub, tmp_path / 'pull-home', f'hf-hub:{repo}@{commit}', images, tmp_path / 'pulled.pt')
    logits, state_dict = reference_logits(train_run, images, weights='state_dict_ema')
    assert torch.equal(pulled['logits'], logits)
    assert_same_tensors(pulled['state_dict'], state_dict)
    assert pulled['pretrained_cfg']['label_names'] == CIFAR10_LABELS


# --- options, in this process ---------------------------------------------------------------------------------------

@pytest.fixture
def logged_in(hub_cache, monkeypatch):
    monkeypatch.setenv('HF_TOKEN', TOKEN)
    return hub_cache


def test_dry_run_writes_what_push_pushes(logged_in, fresh_hub, train_run, tmp_path, capsys):
    folder = tmp_path / 'dry'
    assert main(['push', str(train_run), '--repo-id', 'push/dry', '--dry-run', str(folder)]) == 0
    assert fresh_hub.requests == []
    assert f'to {folder}; nothing was pushed' in capsys.readouterr().out
    assert main(['push', str(train_run), '--repo-id', 'push/dry']) == 0
    assert fresh_hub.files('push/dry') == {
        '.gitattributes': fresh_hub.files('push/dry')['.gitattributes'],
        **{p.name: p.read_bytes() for p in folder.iterdir()},
    }


def test_label_names_from_a_file(train_run, tmp_path):
    (tmp_path / 'labels.txt').write_text('--label-names\n' + '\n'.join(CIFAR10_LABELS) + '\n')
    folder = tmp_path / 'dry'
    assert main(['push', str(train_run), '--repo-id', 'push/labels', f'@{tmp_path / "labels.txt"}',
                 '--dry-run', str(folder)]) == 0
    assert json.loads((folder / 'config.json').read_text())['label_names'] == CIFAR10_LABELS


def test_without_label_names_the_registry_s_class_names_are_not_published(train_run, tmp_path):
    """The architecture's default tag names CIFAR-10's classes, those of its shipped weights, not of a checkpoint of
    another run: a push publishes class names only where --label-names gives them."""
    assert timm.create_model(HYPERBF).pretrained_cfg['label_names']
    folder = tmp_path / 'dry'
    assert main(['push', str(train_run), '--repo-id', 'push/unlabelled', '--dry-run', str(folder)]) == 0
    config = json.loads((folder / 'config.json').read_text())
    assert 'label_names' not in config and 'label_names' not in config['pretrained_cfg']


def test_dry_run_in_bfloat16_halves_the_weights_but_the_kernel_widths_and_timm_loads_them_into_float32(
        train_run, cifar10_sample, tmp_path):
    full, half = tmp_path / 'float32', tmp_path / 'bfloat16'
    assert main(['push', str(train_run), '--repo-id', 'push/bf16', '--dry-run', str(full)]) == 0
    assert main(['push', str(train_run), '--repo-id', 'push/bf16', '--dtype', 'bfloat16', '--dry-run', str(half)]) == 0
    weights = load_file(half / 'model.safetensors')
    float32 = {name for name, t in weights.items() if t.dtype != torch.bfloat16}
    assert float32 and all(name.endswith('.log_gamma') and weights[name].dtype == torch.float32 for name in float32)
    exact_weights = load_file(full / 'model.safetensors')
    assert all(torch.equal(weights[name], exact_weights[name]) for name in float32)  # the widths as trained, unrounded
    assert any(not torch.equal(exact_weights[name], exact_weights[name].bfloat16().float()) for name in float32)
    assert (half / 'model.safetensors').stat().st_size < 0.51 * (full / 'model.safetensors').stat().st_size

    model = timm.create_model(f'local-dir:{half}', pretrained=True).eval()
    exact = timm.create_model(f'local-dir:{full}', pretrained=True).eval()
    state = model.state_dict()
    assert all(state[k].dtype == torch.float32 and torch.equal(state[k], w.float()) for k, w in weights.items())
    dataset = ImageDataset(str(cifar10_sample / 'test'), transform=create_transform(**resolve_data_config(model=model)))
    images = torch.stack([dataset[i][0] for i in range(0, len(dataset), 10)])
    with torch.no_grad():
        logits, exact_logits = model(images), exact(images)
    assert not torch.equal(logits, exact_logits)  # the weights were rounded ...
    torch.testing.assert_close(logits, exact_logits, atol=0.05 * exact_logits.abs().max().item(), rtol=0.05)  # ... only


def test_a_bare_state_dict_pushes_with_the_model_arguments_given(tmp_path):
    """Nothing records a bare state dict's model arguments, and some change no shape (the kernel): --model-kwargs
    names them, as train.py's does, and the pushed model computes what the trained one did."""
    torch.manual_seed(0)
    trained = timm.create_model(HYPERBF, depth=2, img_size=32, patch_size=4, num_classes=10, kernel='laplacian').eval()
    save_file(trained.state_dict(), tmp_path / 'weights.safetensors')
    folder = tmp_path / 'repo'
    assert main(['push', str(tmp_path / 'weights.safetensors'), '--repo-id', 'push/bare', '--model', HYPERBF,
                 '--model-kwargs', 'depth=2', 'img_size=32', 'patch_size=4', 'kernel=laplacian',
                 '--dry-run', str(folder)]) == 0
    assert json.loads((folder / 'config.json').read_text())['model_args']['kernel'] == 'laplacian'
    pushed = timm.create_model(f'local-dir:{folder}', pretrained=True).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(pushed(x), trained(x))


def test_a_run_trained_with_gp_avg_is_pushed_with_global_pool_avg_and_loads_back_pooling_so(avg_pool_train_run,
                                                                                           tmp_path):
    """train.py's --gp is a model argument in config.json: the pushed model pools as the trained one did and
    computes what it did."""
    folder = tmp_path / 'dry'
    assert main(['push', str(avg_pool_train_run), '--repo-id', 'push/avg', '--dry-run', str(folder)]) == 0
    assert json.loads((folder / 'config.json').read_text())['model_args']['global_pool'] == 'avg'
    pushed = timm.create_model(f'local-dir:{folder}', pretrained=True).eval()
    trained = read_train_output(avg_pool_train_run).create_model()
    assert pushed.global_pool == 'avg'
    assert_same_tensors(pushed.state_dict(), trained.state_dict())
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(pushed(x), trained(x))


@pytest.mark.parametrize('model_kwargs, input_size, fixed', [
    (dict(img_size=48), (3, 48, 48), True),
    (dict(in_chans=1), (1, 32, 32), True),
    (dict(dynamic_img_size=True), (3, 32, 32), False),
])
def test_a_model_of_another_input_than_its_tag_s_is_pushed_with_that_input(tmp_path, model_kwargs, input_size, fixed):
    """config.json and the model card describe the model pushed, not its tag (32 x 32, 3 channels): its image size,
    channels (the normalisation averaged over them) and whether the size is fixed; it loads at that size."""
    torch.manual_seed(0)
    trained = timm.create_model(HYPERBF, depth=1, **model_kwargs).eval()
    torch.save(trained.state_dict(), tmp_path / 'weights.pth')
    kwargs = [f'{k}={v}' for k, v in model_kwargs.items() if k != 'in_chans']  # the stem gives the channels
    folder = tmp_path / 'repo'
    assert main(['push', str(tmp_path / 'weights.pth'), '--repo-id', 'push/input', '--model', HYPERBF,
                 '--model-kwargs', 'depth=1', *kwargs, '--dry-run', str(folder)]) == 0
    cfg = json.loads((folder / 'config.json').read_text())['pretrained_cfg']
    assert (tuple(cfg['input_size']), cfg['fixed_input_size']) == (input_size, fixed)
    assert len(cfg['mean']) == len(cfg['std']) == input_size[0]
    assert f'**Image size:** {input_size[1]} x {input_size[2]}' in (folder / 'README.md').read_text()
    pushed = timm.create_model(f'local-dir:{folder}', pretrained=True).eval()
    x = torch.randn(2, *resolve_data_config({}, model=pushed)['input_size'])
    assert x.shape[1:] == input_size
    with torch.no_grad():
        assert torch.equal(pushed(x), trained(x))


def test_private_repo(logged_in, fresh_hub, train_run):
    assert main(['push', str(train_run), '--repo-id', 'push/private', '--private']) == 0
    assert fresh_hub.repos['push/private'].private


def test_revision_commits_to_a_new_branch(logged_in, fresh_hub, train_run):
    assert main(['push', str(train_run), '--repo-id', 'push/branch', '--revision', 'dev']) == 0
    assert set(fresh_hub.files('push/branch', 'dev')) == PUSHED_FILES
    assert set(fresh_hub.files('push/branch', 'main')) == {'.gitattributes'}


def test_create_pr(logged_in, fresh_hub, train_run, capsys):
    assert main(['push', str(train_run), '--repo-id', 'push/pr', '--create-pr']) == 0
    assert f'{fresh_hub.endpoint}/push/pr/discussions/1' in capsys.readouterr().out
    assert set(fresh_hub.files('push/pr', 'refs/pr/1')) == PUSHED_FILES
    assert set(fresh_hub.files('push/pr', 'main')) == {'.gitattributes'}


def test_pytorch_bin_only_when_asked(logged_in, fresh_hub, train_run):
    assert main(['push', str(train_run), '--repo-id', 'push/bin', '--pytorch-bin']) == 0
    assert set(fresh_hub.files('push/bin')) == PUSHED_FILES | {'pytorch_model.bin'}


# --- failures -------------------------------------------------------------------------------------------------------

def test_not_logged_in(hub_cache, fresh_hub, train_run, capsys):
    assert main(['push', str(train_run), '--repo-id', 'push/anonymous']) == 1
    assert capsys.readouterr().err == (
        'error: Pushing to push/anonymous@main failed: you are not logged in (HTTP 401): log in with '
        '`hf auth login` or set HF_TOKEN to a token with write access to push.\n')
    assert 'push/anonymous' not in fresh_hub.repos


def test_token_refused(hub_cache, fresh_hub, train_run, monkeypatch, capsys):
    monkeypatch.setenv('HF_TOKEN', 'hf_not_a_valid_token')
    assert main(['push', str(train_run), '--repo-id', 'push/refused']) == 1
    assert 'failed: the Hub refused your token (HTTP 401): log in with `hf auth login`' in capsys.readouterr().err


@pytest.mark.parametrize('refused', ['create', 'commit'])
def test_a_token_without_write_access_says_to_use_one_that_has_it_and_changes_nothing(logged_in, fresh_hub,
                                                                                       train_run, capsys, refused):
    """HTTP 403: the token may not create a repo in the organisation, or not commit to its existing repo."""
    repo = f'other-org/forbidden-{refused}'
    if refused == 'commit':
        fresh_hub.publish(repo, {'README.md': b'their model'})
        before = fresh_hub.files(repo)
        fresh_hub.fail('POST', f'/api/models/{repo}/commit/main', 'status', status=403)
    else:
        fresh_hub.fail('POST', '/api/repos/create', 'status', status=403)
    assert main(['push', str(train_run), '--repo-id', repo]) == 1
    assert capsys.readouterr().err.endswith(  # after the progress bars of the upload, where there was one
        f'error: Pushing to {repo}@main failed: the Hub refused your token (HTTP 403): log in with `hf auth login` or '
        'set HF_TOKEN to a token with write access to other-org.\n')
    if refused == 'commit':
        assert fresh_hub.files(repo) == before
    else:
        assert repo not in fresh_hub.repos


@pytest.mark.parametrize('method, path, kind, message', [
    ('POST', '/api/models/*/commit/*', 'status', r'http://\S+ answered HTTP 500 \(.+\)\. Run again later\.'),
    ('PUT', '/_lfs/*', 'drop', r'no answer from http://\S+ \(RemoteProtocolError: Server disconnected'),
])
def test_lasting_fault_commits_nothing(logged_in, fresh_hub, train_run, no_backoff, capsys, method, path, kind,
                                       message):
    fresh_hub.fail(method, path, kind, times=20)
    repo = f'push/faulty-{kind}'  # a repo of its own: its LFS files are not on the Hub yet
    assert main(['push', str(train_run), '--repo-id', repo]) == 1
    assert re.search(f'error: Pushing to {repo}@main failed: {message}', capsys.readouterr().err)
    assert set(fresh_hub.files(repo)) == {'.gitattributes'}


@pytest.mark.parametrize('failure', ['name not resolved', 'connection refused'])
def test_a_hub_out_of_reach_says_so_and_where(logged_in, fresh_hub, train_run, no_backoff, monkeypatch, capsys,
                                              failure):
    """No network, a wrong HF_ENDPOINT, a proxy that is not there: no connection opens."""
    if failure == 'name not resolved':
        endpoint, cause = 'http://hub.invalid', '[Errno -2] Name or service not known'

        def getaddrinfo(*args, **kwargs):  # what the resolver says without a network
            raise socket.gaierror(-2, 'Name or service not known')
        monkeypatch.setattr(socket, 'getaddrinfo', getaddrinfo)
    else:
        with socket.socket() as s:  # a port nothing listens on
            s.bind(('127.0.0.1', 0))
            endpoint, cause = f'http://127.0.0.1:{s.getsockname()[1]}', '[Errno 111] Connection refused'
    monkeypatch.setattr(constants, 'ENDPOINT', endpoint)
    assert main(['push', str(train_run), '--repo-id', 'push/out-of-reach']) == 1
    assert capsys.readouterr().err == (
        f'error: Pushing to push/out-of-reach@main failed: no answer from {endpoint} (ConnectError: {cause}). Check '
        'the network connection, the proxy settings and HF_ENDPOINT, and run again.\n')
    assert fresh_hub.requests == []


def test_checkpoint_of_another_architecture_is_refused_before_any_request(logged_in, fresh_hub, train_run, capsys):
    assert main(['push', str(train_run), '--repo-id', 'push/small', '--model', 'vit_hyperbf_small']) == 1
    assert 'does not fit vit_hyperbf_small' in capsys.readouterr().err
    assert fresh_hub.requests == []


def test_pushed_repo_through_the_hub_api(logged_in, fresh_hub, train_run, tmp_path):
    """Model info, the file tree and a snapshot download of a pushed repo: what other Hub clients see."""
    assert main(['push', str(train_run), '--repo-id', 'push/api']) == 0
    commit, files = fresh_hub.repos['push/api'].refs['main'], fresh_hub.files('push/api')
    api = HfApi()
    info = api.model_info('push/api')
    assert info.sha == commit and {s.rfilename for s in info.siblings} == PUSHED_FILES
    tree = {entry.path: entry for entry in api.list_repo_tree('push/api', recursive=True)}
    assert tree.keys() == PUSHED_FILES
    assert tree['model.safetensors'].lfs.sha256 == hashlib.sha256(files['model.safetensors']).hexdigest()
    assert tree['config.json'].lfs is None and tree['config.json'].size == len(files['config.json'])
    snapshot = Path(snapshot_download('push/api', local_dir=tmp_path / 'snapshot'))
    assert {p.name: p.read_bytes() for p in snapshot.iterdir() if p.is_file()} == files


# --- bad input: refused before any request, the Hub and the local cache untouched ----------------------------------

def failed_push(hub, cache, capsys, checkpoint, *args: str) -> str:
    """``timm-hbf push CHECKPOINT ARGS``, which must fail without a request; its error message."""
    assert main(['push', str(checkpoint), '--repo-id', 'push/bad-input', *args]) == 1
    assert hub.requests == [] and 'push/bad-input' not in hub.repos and not cache.exists()
    return capsys.readouterr().err


def test_a_missing_checkpoint_push_names_the_file(logged_in, fresh_hub, tmp_path, capsys):
    assert failed_push(fresh_hub, logged_in, capsys, tmp_path / 'best.pth.tar') == (
        f'error: {tmp_path}/best.pth.tar does not exist. Name the weights file.\n')


def test_a_folder_without_checkpoint_push_says_to_name_one(logged_in, fresh_hub, tmp_path, capsys):
    assert failed_push(fresh_hub, logged_in, capsys, tmp_path) == (
        f'error: {tmp_path} has no model_best.pth.tar or last.pth.tar: name the checkpoint to push.\n')


@pytest.mark.parametrize('name, cut', [
    ('last.pth.tar', 'empty'),
    ('w.safetensors', 'truncated'),
    ('last.pth.tar', 'truncated'),
    ('w.safetensors', 'a torch.save file'),
    ('args.pth', 'text'),
])
def test_a_checkpoint_that_cannot_be_read_push_names_it_in_one_line(logged_in, fresh_hub, train_run, tmp_path, capsys,
                                                                    name, cut):
    checkpoint = (train_run / 'last.pth.tar').read_bytes()
    if name.endswith('.safetensors') and cut == 'truncated':
        save_file(read_train_output(train_run).state_dict, tmp_path / 'full.safetensors')
        checkpoint = (tmp_path / 'full.safetensors').read_bytes()
    content = {'empty': b'', 'truncated': checkpoint[:-1000], 'a torch.save file': checkpoint,
               'text': b'model: vit_hyperbf_tiny\n'}[cut]
    (tmp_path / name).write_bytes(content)
    message = failed_push(fresh_hub, logged_in, capsys, tmp_path / name, '--model', HYPERBF)
    assert message.startswith(f'error: {tmp_path}/{name} cannot be read (') and message.count('\n') == 1
    assert message.endswith('): it is cut short, damaged, or not of the format its name says (.safetensors for '
                            'safetensors, any other for torch.save). Save or copy the weights again.\n')


def test_weights_of_the_other_family_push_says_they_do_not_fit(logged_in, fresh_hub, train_run, tmp_path, capsys):
    save_file(read_train_output(train_run).state_dict, tmp_path / 'hyperbf.safetensors')
    message = failed_push(fresh_hub, logged_in, capsys, tmp_path / 'hyperbf.safetensors', '--model', 'vit_qimia_tiny')
    assert message.startswith(f"error: {tmp_path}/hyperbf.safetensors does not fit vit_qimia_tiny built with "
                              "{'num_classes': 10, 'in_chans': 3} (no model arguments: neither the checkpoint nor an "
                              "args.yaml beside it records them): ")
    assert ' missing (' in message and ' unexpected (' in message
    assert message.endswith(". Give the model arguments it was trained with (train.py's --model-kwargs, e.g. depth=2) "
                            'with --model-kwargs; check --model too.\n')


def test_a_bare_state_dict_of_other_model_arguments_push_says_to_give_them(logged_in, fresh_hub, tmp_path, capsys):
    """--model names the architecture: what is missing is the model arguments, which nothing records here."""
    torch.save(timm.create_model(HYPERBF, depth=1).state_dict(), tmp_path / 'hbf_sd.pth')
    message = failed_push(fresh_hub, logged_in, capsys, tmp_path / 'hbf_sd.pth', '--model', HYPERBF)
    assert message == (
        f"error: {tmp_path}/hbf_sd.pth does not fit vit_hyperbf_tiny built with {{'num_classes': 10, 'in_chans': 3}} "
        '(no model arguments: neither the checkpoint nor an args.yaml beside it records them): 143 missing '
        '(blocks.1.norm1.weight, blocks.1.norm1.bias, blocks.1.attn.qkv.weight, ...). Give the model arguments it '
        "was trained with (train.py's --model-kwargs, e.g. depth=2) with --model-kwargs; check --model too.\n")


def test_model_arguments_given_that_the_model_does_not_take_push_says_to_fix_model_kwargs(logged_in, fresh_hub,
                                                                                          train_run, capsys):
    """The run has an args.yaml, but --model-kwargs takes its place: the message names the option, not the file."""
    message = failed_push(fresh_hub, logged_in, capsys, train_run, '--model-kwargs', 'depth=2', 'bogus=3')
    assert message == (
        "error: vit_hyperbf_tiny cannot be built with {'depth': 2, 'bogus': 3, 'num_classes': 10, 'in_chans': 3} "
        "(the model arguments given with --model-kwargs): VisionTransformer.__init__() got an unexpected keyword "
        "argument 'bogus'. Give the model arguments it was trained with (train.py's --model-kwargs, e.g. depth=2) with "
        f'--model-kwargs; if it was not trained as vit_hyperbf_tiny ({train_run}/args.yaml says so), name its '
        'architecture with --model.\n')


@pytest.mark.parametrize('existing', ['empty folder', 'folder', 'file'])
def test_a_dry_run_into_an_existing_path_is_refused_and_leaves_it_as_it_was(train_run, tmp_path, capsys, existing):
    """--dry-run writes a new folder, all or nothing: an existing one (even empty) or a file there is left alone."""
    target = tmp_path / 'dry'
    if existing == 'file':
        target.write_text('notes\n')
    else:
        target.mkdir()
        if existing == 'folder':
            (target / 'config.json').write_text('{"architecture": "mine"}')
    assert main(['push', str(train_run), '--repo-id', 'push/exists', '--dry-run', str(target)]) == 1
    assert capsys.readouterr().err == f'error: {target} already exists: name a new folder.\n'
    assert [p.name for p in tmp_path.iterdir()] == ['dry']  # no partial folder beside it
    if existing == 'file':
        assert target.read_text() == 'notes\n'
    else:
        assert {p.name: p.read_text() for p in target.iterdir()} == (
            {'config.json': '{"architecture": "mine"}'} if existing == 'folder' else {})


@pytest.mark.parametrize('write', ['write_repo_folder', 'push_to_hub'])
def test_the_python_api_refuses_a_repo_id_that_is_not_org_and_name_before_writing(logged_in, fresh_hub, train_run,
                                                                                  tmp_path, write):
    train = read_train_output(train_run)
    with pytest.raises(HubError, match=r"^repo_id must be ORG/NAME: names of letters, .*, got 'a/b c'\.$"):
        if write == 'write_repo_folder':
            write_repo_folder(train, tmp_path / 'dry', 'a/b c')
        else:
            push_to_hub(train, 'a/b c')
    assert not (tmp_path / 'dry').exists() and fresh_hub.requests == []


def test_a_dry_run_under_a_file_says_it_cannot_write_there(train_run, tmp_path, capsys):
    (tmp_path / 'last.pth.tar').write_bytes(b'weights')
    target = tmp_path / 'last.pth.tar' / 'dry'
    assert main(['push', str(train_run), '--repo-id', 'push/under-a-file', '--dry-run', str(target)]) == 1
    assert capsys.readouterr().err == (
        f"error: cannot write {target}: [Errno 20] Not a directory: '{target}'. Choose a writable folder with free "
        'space.\n')
    assert [p.name for p in tmp_path.iterdir()] == ['last.pth.tar'] and target.parent.read_bytes() == b'weights'


@pytest.mark.skipif(os.geteuid() == 0, reason='root writes into read-only folders')
def test_a_dry_run_into_a_read_only_folder_says_it_cannot_write_there(train_run, tmp_path, capsys):
    (tmp_path / 'read-only').mkdir(mode=0o555)
    target = tmp_path / 'read-only' / 'dry'
    try:
        assert main(['push', str(train_run), '--repo-id', 'push/read-only', '--dry-run', str(target)]) == 1
    finally:
        target.parent.chmod(0o755)
    message = capsys.readouterr().err
    assert message.startswith(f'error: cannot write {target}: [Errno 13] Permission denied: ')
    assert message.endswith('. Choose a writable folder with free space.\n') and not any(target.parent.iterdir())


# What a write onto a full disk raises: safetensors' writer its own error, the others an OSError
DISK_FULL = {'weights': SafetensorError('Error while serializing: I/O error: No space left on device (os error 28)'),
             'training curves': OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))}
WRITERS = {'weights': (safetensors.torch, 'save_file'), 'training curves': (push, 'plot_training_curves')}


def fill_the_disk(monkeypatch, writing: str) -> None:
    """The disk fills up while ``writing`` is written."""
    def full(*args, **kwargs):
        raise DISK_FULL[writing]
    monkeypatch.setattr(*WRITERS[writing], full)


@pytest.mark.parametrize('writing', ['weights', 'training curves'])
def test_a_dry_run_onto_a_full_disk_says_so_and_leaves_no_partial_folder(train_run, tmp_path, monkeypatch, capsys,
                                                                         writing):
    fill_the_disk(monkeypatch, writing)
    target = tmp_path / 'dry'
    assert main(['push', str(train_run), '--repo-id', 'push/full', '--dry-run', str(target)]) == 1
    assert capsys.readouterr().err == (
        f'error: cannot write {target}: {DISK_FULL[writing]}. Choose a writable folder with free space.\n')
    assert list(tmp_path.iterdir()) == []


def test_a_push_onto_a_full_temporary_folder_says_to_free_space_or_set_tmpdir(logged_in, fresh_hub, train_run,
                                                                              monkeypatch, capsys):
    fill_the_disk(monkeypatch, 'training curves')
    assert main(['push', str(train_run), '--repo-id', 'push/full-tmp']) == 1
    assert re.fullmatch(r'error: cannot write \S+/repo: \[Errno 28\] No space left on device\. Choose a temporary '
                        r'folder \(TMPDIR\) with free space\.\n',
                        capsys.readouterr().err)
    assert fresh_hub.requests == []


def test_a_push_with_hf_hub_offline_says_to_unset_it(logged_in, fresh_hub, train_run, monkeypatch, capsys):
    monkeypatch.setattr(constants, 'HF_HUB_OFFLINE', True)
    assert failed_push(fresh_hub, logged_in, capsys, train_run) == (
        'error: Pushing to push/bad-input needs the network, but HF_HUB_OFFLINE=1 is set: unset HF_HUB_OFFLINE to '
        'push (timm-hbf push --dry-run writes the files without pushing).\n')


def test_an_args_yaml_that_is_no_yaml_push_names_it(logged_in, fresh_hub, train_run, tmp_path, capsys):
    run = shutil.copytree(train_run, tmp_path / 'run')
    (run / 'args.yaml').write_text('model: [vit_hyperbf_tiny\n')
    message = failed_push(fresh_hub, logged_in, capsys, run)
    assert message.startswith(f'error: {run}/args.yaml is not valid YAML (while parsing a flow sequence')
    assert message.endswith('Repair or remove it: without it, the arguments stored in the checkpoint are used.\n')


def test_a_summary_csv_cut_short_push_names_its_line(logged_in, fresh_hub, train_run, tmp_path, capsys):
    run = shutil.copytree(train_run, tmp_path / 'run')
    summary = (run / 'summary.csv').read_text()
    (run / 'summary.csv').write_text(summary[:summary.rindex(',')])  # the last row without its last value
    assert failed_push(fresh_hub, logged_in, capsys, run) == (
        f'error: {run}/summary.csv line 5 is not a row of numbers (float() argument must be a string or a real '
        "number, not 'NoneType'). Repair or remove it: without it, the model card shows no training curves.\n")


def test_model_arguments_the_model_does_not_take_push_names_them(logged_in, fresh_hub, train_run, tmp_path, capsys):
    run = shutil.copytree(train_run, tmp_path / 'run')
    args = yaml.safe_load((run / 'args.yaml').read_text())
    (run / 'args.yaml').write_text(yaml.safe_dump(dict(args, model_kwargs={'depht': 2})))
    message = failed_push(fresh_hub, logged_in, capsys, run)
    assert message.startswith(
        f"error: vit_hyperbf_tiny cannot be built with {{'depht': 2, 'num_classes': 10, 'in_chans': 3}} (the model "
        f"arguments of {run}/args.yaml): ")
    assert "'depht'" in message and message.endswith(
        ". Give the model arguments it was trained with (train.py's --model-kwargs, e.g. depth=2) with "
        f'--model-kwargs; if it was not trained as vit_hyperbf_tiny '
        f'({run}/args.yaml says so), name its architecture with --model.\n')
