"""Creating models from Hub repos pushed with ``timm-hbf push``: timm's ``hf-hub:`` loading, with adaptation, pinned
revisions and offline reuse, and the checks of the families' builder (weights that do not fit the model as built)."""
import io
import json
import re

import pytest
import safetensors.torch
import timm
import torch
from huggingface_hub import constants
from timm.layers import resample_abs_pos_embed

from timm_hbf.models import PretrainedWeightsError

from .conftest import CIFAR10_LABELS, assert_clean_cache, assert_same_tensors
from .test_train_output import Payload


@pytest.fixture(scope='session')
def published(hub, repo_folder):
    """The dry-run folder of the training run, on the Hub as ``pull/published``; its weights."""
    hub.publish('pull/published', {p.name: p.read_bytes() for p in repo_folder.iterdir()})
    return 'pull/published', safetensors.torch.load_file(repo_folder / 'model.safetensors')


def config_of(repo_folder) -> dict:
    return json.loads((repo_folder / 'config.json').read_text())


def pickled(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def pull(repo: str, **kwargs) -> torch.nn.Module:
    return timm.create_model(f'hf-hub:{repo}', pretrained=True, **kwargs)


# --- loading -------------------------------------------------------------------------------------------------------

def test_a_pushed_repo_loads_its_weights_and_class_names(hub_cache, published):
    repo, weights = published
    model = pull(repo)
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
        assert_same_tensors(pull(f'{repo}@{first}').state_dict(), weights)
        assert_same_tensors(pull(repo).state_dict(), changed)
    finally:
        hub.publish(repo, {'model.safetensors': (repo_folder / 'model.safetensors').read_bytes()})


def test_offline_reuse_makes_no_requests(hub_cache, fresh_hub, published, monkeypatch):
    repo, weights = published
    pull(repo)
    fresh_hub.requests.clear()
    monkeypatch.setattr(constants, 'HF_HUB_OFFLINE', True)
    assert_same_tensors(pull(repo).state_dict(), weights)
    assert fresh_hub.requests == []


def test_pickled_weights_load_weights_only(hub_cache, hub, published, repo_folder, monkeypatch):
    _, weights = published
    hub.publish('pull/bin-only', {'config.json': (repo_folder / 'config.json').read_bytes(),
                                   'pytorch_model.bin': pickled(weights)})
    assert_same_tensors(pull('pull/bin-only').state_dict(), weights)
    assert_clean_cache(hub_cache)
    monkeypatch.setattr(constants, 'HF_HUB_OFFLINE', True)  # and again from the cache
    assert_same_tensors(pull('pull/bin-only').state_dict(), weights)


# --- weights that do not fit the model as built: named by the builder, with the fix -------------------------------

@pytest.mark.parametrize('architecture, model_args', [
    ('vit_hyperbf_small', {'depth': 2}),  # another architecture
    ('vit_hyperbf_tiny', {'depth': 3}),  # another shape
])
def test_weights_of_another_architecture_or_shape_say_what_differs(hub_cache, hub, repo_folder, architecture,
                                                                    model_args):
    config = config_of(repo_folder)
    config.update(architecture=architecture, model_args=dict(config['model_args'], **model_args))
    repo = f'pull/{architecture}-{model_args["depth"]}'
    hub.publish(repo, {'config.json': json.dumps(config).encode(),
                       'model.safetensors': (repo_folder / 'model.safetensors').read_bytes()})
    with pytest.raises(PretrainedWeightsError, match=f'^hf-hub:{repo} does not fit {architecture} as built: .*'
                                                     r'(blocks|wide).*create'):
        pull(repo)


def test_arguments_that_change_the_model_are_named_with_the_fix(hub_cache, published):
    repo, _ = published
    with pytest.raises(PretrainedWeightsError, match=re.escape(
            f'hf-hub:{repo} does not fit vit_hyperbf_tiny as built: 2 missing (fc_norm.weight, fc_norm.bias); 2 '
            'unexpected (norm.bias, norm.weight).') + '.* pass fc_norm=False'):
        pull(repo, global_pool='avg')
    assert pull(repo, global_pool='avg', fc_norm=False).global_pool == 'avg'


def test_pickled_code_in_weights_never_runs(hub_cache, hub, repo_folder, tmp_path, monkeypatch):
    mark = tmp_path / 'payload-ran'
    monkeypatch.setenv('PAYLOAD_MARK', str(mark))
    hub.publish('pull/evil', {'config.json': (repo_folder / 'config.json').read_bytes(),
                               'pytorch_model.bin': pickled({'head.weight': Payload()})})
    with pytest.raises(Exception, match=r'[Ww]eights[ _]only'):
        pull('pull/evil')
    assert not mark.exists()
