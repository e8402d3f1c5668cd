"""Creating models from Hub repos: timm's ``hf-hub:`` loading with adaptation, pinned revisions and offline reuse, and
:func:`create_model_from_hub`, whose every failure says what to do and leaves a clean cache."""
import fnmatch
import io
import json
import re
import socket

import pytest
import safetensors.torch
import timm
import torch
from huggingface_hub import constants
from timm.layers import resample_abs_pos_embed

from timm_hbf.hub import HubError, create_model_from_hub

from .conftest import CIFAR10_LABELS, TOKEN, assert_clean_cache
from .test_train_output import Payload


@pytest.fixture(scope='session')
def published(hub, repo_folder):
    """The dry-run folder of the training run, on the Hub as ``pull/published``; its weights."""
    hub.publish('pull/published', {p.name: p.read_bytes() for p in repo_folder.iterdir()})
    return 'pull/published', safetensors.torch.load_file(repo_folder / 'model.safetensors')


def assert_same_tensors(a, b):
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def config_of(repo_folder) -> dict:
    return json.loads((repo_folder / 'config.json').read_text())


def pickled(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


# --- loading -------------------------------------------------------------------------------------------------------

def test_create_model_from_hub_loads_the_pushed_weights(hub_cache, published):
    repo, weights = published
    model = create_model_from_hub(repo)
    assert_same_tensors(model.state_dict(), weights)
    assert model.pretrained_cfg['label_names'] == CIFAR10_LABELS
    assert_clean_cache(hub_cache)


def test_num_classes_in_chans_and_img_size_adapt_as_for_timm_models(hub_cache, published):
    repo, weights = published
    model = timm.create_model(f'hf-hub:{repo}', pretrained=True, num_classes=5, in_chans=1, img_size=64)
    state = model.state_dict()
    assert state['head.weight'].shape == (5, 192)  # a new head
    torch.testing.assert_close(state['patch_embed.proj.weight'], weights['patch_embed.proj.weight'].sum(1, True))
    torch.testing.assert_close(state['pos_embed'], resample_abs_pos_embed(weights['pos_embed'], [16, 16]))
    assert all(torch.equal(v, weights[k]) for k, v in state.items() if k.startswith('blocks.'))
    assert model(torch.randn(2, 1, 64, 64)).shape == (2, 5)


def test_pinned_revision(hub_cache, hub, published, repo_folder):
    repo, weights = published
    first = hub.repos[repo].refs['main']
    changed = {k: v + 1 for k, v in weights.items()}
    hub.publish(repo, {'model.safetensors': safetensors.torch.save(changed)})
    try:
        assert_same_tensors(create_model_from_hub(f'{repo}@{first}').state_dict(), weights)
        assert_same_tensors(timm.create_model(f'hf-hub:{repo}', pretrained=True).state_dict(), changed)
    finally:
        hub.publish(repo, {'model.safetensors': (repo_folder / 'model.safetensors').read_bytes()})


def test_offline_reuse_makes_no_requests(hub_cache, fresh_hub, published, monkeypatch):
    repo, weights = published
    create_model_from_hub(repo)
    fresh_hub.requests.clear()
    monkeypatch.setattr(constants, 'HF_HUB_OFFLINE', True)
    assert_same_tensors(create_model_from_hub(repo).state_dict(), weights)
    assert_same_tensors(timm.create_model(f'hf-hub:{repo}', pretrained=True).state_dict(), weights)
    assert fresh_hub.requests == []


def test_pickled_weights_load_weights_only(hub_cache, hub, published, repo_folder, monkeypatch):
    _, weights = published
    hub.publish('pull/bin-only', {'config.json': (repo_folder / 'config.json').read_bytes(),
                                   'pytorch_model.bin': pickled(weights)})
    assert_same_tensors(create_model_from_hub('pull/bin-only').state_dict(), weights)
    assert_clean_cache(hub_cache)
    monkeypatch.setattr(constants, 'HF_HUB_OFFLINE', True)  # and again from the cache
    assert_same_tensors(create_model_from_hub('pull/bin-only').state_dict(), weights)


# --- failures ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('repo, message', [
    ('pull/missing', r'has no repo pull/missing, or it is private and you are not logged in\. Check the repo id; '
                      r'for a private repo, log in with `hf auth login` or set HF_TOKEN\.'),
    ('pull/published@v9', r"has no branch, tag or commit 'v9'"),
    ('not/a/repo', r"'not/a/repo' is not a repo id; use ORG/NAME"),
])
def test_repo_or_revision_not_found(hub_cache, published, repo, message):
    with pytest.raises(HubError, match=message):
        create_model_from_hub(repo)
    assert_clean_cache(hub_cache)


def test_repo_not_found_with_a_token(hub_cache, monkeypatch):
    monkeypatch.setenv('HF_TOKEN', TOKEN)
    with pytest.raises(HubError, match='has no repo pull/missing, or your token may not read it'):
        create_model_from_hub('pull/missing')


def test_file_not_found(hub_cache, hub, published, repo_folder):
    hub.publish('pull/card-only', {'README.md': b'# no model here'})
    with pytest.raises(HubError, match=r'Downloading config.json from pull/card-only@main failed: the file is not'):
        create_model_from_hub('pull/card-only')
    hub.publish('pull/no-weights', {'config.json': (repo_folder / 'config.json').read_bytes()})
    with pytest.raises(HubError, match=r'has no weights: neither model.safetensors nor pytorch_model.bin\. Create '
                                       r'the model with pretrained=False'):
        create_model_from_hub('pull/no-weights')
    assert create_model_from_hub('pull/no-weights', pretrained=False).num_classes == 10
    assert_clean_cache(hub_cache)


def test_unauthorised(hub_cache, hub, repo_folder, monkeypatch):
    hub.publish('pull/private', {p.name: p.read_bytes() for p in repo_folder.iterdir()}, private=True)
    with pytest.raises(HubError, match='or it is private and you are not logged in'):
        create_model_from_hub('pull/private')
    monkeypatch.setenv('HF_TOKEN', 'hf_not_a_valid_token')
    with pytest.raises(HubError, match=r'the Hub refused your token \(HTTP 401\): log in with `hf auth login`'):
        create_model_from_hub('pull/private')
    monkeypatch.setenv('HF_TOKEN', TOKEN)
    assert create_model_from_hub('pull/private').num_classes == 10
    assert_clean_cache(hub_cache)


def test_gated(hub_cache, hub, repo_folder, monkeypatch):
    hub.publish('pull/gated', {p.name: p.read_bytes() for p in repo_folder.iterdir()}, gated=True)
    with pytest.raises(HubError, match=r'the repo is gated\. Request access on http://\S+/pull/gated, then log in'):
        create_model_from_hub('pull/gated')
    monkeypatch.setenv('HF_TOKEN', TOKEN)
    assert create_model_from_hub('pull/gated').num_classes == 10
    assert_clean_cache(hub_cache)


def test_unknown_architecture_says_to_install_timm_hbf(hub_cache, hub, repo_folder):
    config = dict(config_of(repo_folder), architecture='vit_hyperbf_future')
    hub.publish('pull/future', {'config.json': json.dumps(config).encode(),
                                 'model.safetensors': (repo_folder / 'model.safetensors').read_bytes()})
    with pytest.raises(HubError, match=r"holds a 'vit_hyperbf_future', an architecture that timm .* does not know\. "
                                       r'If it is a timm-hbf model: pip install -U timm-hbf, and import timm_hbf'):
        create_model_from_hub('pull/future')


@pytest.mark.parametrize('architecture, model_args', [
    ('vit_hyperbf_small', {'depth': 2}),  # another architecture
    ('vit_hyperbf_tiny', {'depth': 3}),  # another shape
])
def test_weights_of_another_architecture_or_shape(hub_cache, hub, repo_folder, architecture, model_args):
    config = config_of(repo_folder)
    config.update(architecture=architecture, model_args=dict(config['model_args'], **model_args))
    hub.publish(f'pull/{architecture}-{model_args["depth"]}', {
        'config.json': json.dumps(config).encode(),
        'model.safetensors': (repo_folder / 'model.safetensors').read_bytes(),
    })
    with pytest.raises(HubError, match=f'do not fit the {architecture} its config.json describes .* another '
                                       'architecture or shape: push the checkpoint again'):
        create_model_from_hub(f'pull/{architecture}-{model_args["depth"]}')


def test_arguments_that_change_the_model_are_named_with_the_fix(hub_cache, published):
    """Not the repo's fault: the error says what the arguments changed and how to load the weights."""
    repo, _ = published
    given = re.escape("(the model arguments given: {'global_pool': 'avg'})")
    with pytest.raises(HubError, match=f'pass fc_norm=False .*{given}'):
        create_model_from_hub(repo, global_pool='avg')
    assert create_model_from_hub(repo, global_pool='avg', fc_norm=False).global_pool == 'avg'


def test_pickled_code_in_weights_never_runs(hub_cache, hub, repo_folder, tmp_path, monkeypatch):
    mark = tmp_path / 'payload-ran'
    monkeypatch.setenv('PAYLOAD_MARK', str(mark))
    hub.publish('pull/evil', {'config.json': (repo_folder / 'config.json').read_bytes(),
                               'pytorch_model.bin': pickled({'head.weight': Payload()})})
    with pytest.raises(HubError, match='pytorch_model.bin of pull/evil@.* holds Python objects besides tensors'):
        create_model_from_hub('pull/evil')
    with pytest.raises(Exception, match=r'[Ww]eights[ _]only'):
        timm.create_model('hf-hub:pull/evil', pretrained=True)  # timm alone refuses it too
    assert not mark.exists()


def test_truncated_weights_in_the_repo_are_named_and_not_loaded(hub_cache, hub, repo_folder):
    weights = (repo_folder / 'model.safetensors').read_bytes()
    hub.publish('pull/truncated', {'config.json': (repo_folder / 'config.json').read_bytes(),
                                   'model.safetensors': weights[:-1000]})
    with pytest.raises(HubError) as e:
        create_model_from_hub('pull/truncated')
    assert re.fullmatch(
        f'model.safetensors of pull/truncated@[0-9a-f]{{40}} is truncated \\(its header describes {len(weights)} '
        f'bytes, the file has {len(weights) - 1000}\\); it was not loaded. The repo holds it so: ask its publisher '
        'to push the weights again, as model.safetensors.', str(e.value))


def test_offline_without_cache(hub_cache, published, monkeypatch):
    monkeypatch.setattr(constants, 'HF_HUB_OFFLINE', True)
    with pytest.raises(HubError, match='HF_HUB_OFFLINE=1 is set and the file is not in the cache'):
        create_model_from_hub(published[0])


def test_server_unreachable(hub_cache, no_backoff, monkeypatch):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(('127.0.0.1', 0))
        endpoint = f'http://127.0.0.1:{s.getsockname()[1]}'
    monkeypatch.setattr(constants, 'ENDPOINT', endpoint)
    monkeypatch.setattr(constants, 'HUGGINGFACE_CO_URL_TEMPLATE', endpoint + '/{repo_id}/resolve/{revision}/{filename}')
    with pytest.raises(HubError, match=f'cannot reach {endpoint} .*Check the network connection, the proxy '
                                       'settings and HF_ENDPOINT; files already in the cache load offline with '
                                       'HF_HUB_OFFLINE=1'):
        create_model_from_hub('pull/published')
    assert_clean_cache(hub_cache)


# --- faults on the way: transient ones are retried, lasting ones named; the cache stays clean ------------------------

WEIGHTS_HEAD = '/pull/published/resolve/*/model.safetensors'


@pytest.mark.parametrize('method, path, kind, message', [
    ('HEAD', WEIGHTS_HEAD, 'status', r'answered HTTP 500, an error on the server side\. Try again later'),
    ('GET', '/_cdn/*', 'status', r'answered HTTP 500, an error on the server side\. Try again later'),
    ('HEAD', WEIGHTS_HEAD, 'drop', r'the transfer broke off \(RemoteProtocolError: Server disconnected'),
    ('GET', '/_cdn/*', 'drop', r'the transfer broke off \(RemoteProtocolError: Server disconnected'),
    ('GET', '/_cdn/*', 'short', r'the transfer broke off \(OSError: Consistency check failed: file should be of size'),
    ('HEAD', WEIGHTS_HEAD, 'wrong_etag', r'model.safetensors of pull/published@\w+ arrived corrupted: its content '
                                         r'hashes to \w+, the Hub announced \w+\. The damaged download was removed'),
])
def test_lasting_fault_is_named_and_leaves_a_clean_cache(hub_cache, fresh_hub, published, no_backoff, method, path,
                                                         kind, message):
    repo, weights = published
    fresh_hub.fail(method, path, kind, times=20)
    with pytest.raises(HubError, match=message):
        create_model_from_hub(repo)
    assert_clean_cache(hub_cache)
    fresh_hub.faults.clear()
    assert_same_tensors(create_model_from_hub(repo).state_dict(), weights)  # and running again works
    assert_clean_cache(hub_cache)


@pytest.mark.parametrize('method, path, kind', [
    ('HEAD', WEIGHTS_HEAD, 'status'),
    ('GET', '/_cdn/*', 'drop'),
    ('GET', '/_cdn/*', 'truncate'),
])
def test_transient_fault_is_retried(hub_cache, fresh_hub, published, no_backoff, monkeypatch, method, path, kind):
    repo, weights = published
    monkeypatch.setattr(constants, 'DOWNLOAD_CHUNK_SIZE', 1 << 16)  # the client writes what arrived before a break
    fresh_hub.fail(method, path, kind)
    assert_same_tensors(create_model_from_hub(repo).state_dict(), weights)
    tries = [r.status for r in fresh_hub.requests if r.method == method and fnmatch.fnmatch(r.path, path)]
    assert len(tries) == 2 and not fresh_hub.faults
    if kind == 'truncate':  # the download resumed where the connection broke
        assert tries == [200, 206]
    assert_clean_cache(hub_cache)
