"""Pretrained weights through ``build_vit``: a tag's weights file loads offline like timm's own weights, and every bad
tag or weights file is an error that names it, says what is wrong and how to fix it. The models: small HyperBF and
QIMIA ViTs registered here, whose default tag points at a bf16 safetensors file as the shipped weights do."""
import argparse
import sys
from pathlib import Path
from typing import Dict

import pytest
import timm
import torch
from safetensors.torch import load_file, save_file
from timm.models import generate_default_cfgs, register_model
from timm.models.vision_transformer import checkpoint_filter_fn

from timm_hbf.models import PretrainedWeightsError, VisionTransformerHyperBF, VisionTransformerQimia
from timm_hbf.models._builder import build_vit

HYPERBF, QIMIA, UNTRAINED = 'buildertest_hyperbf', 'buildertest_qimia', 'buildertest_untrained'
LABELS = tuple(f'class {i}' for i in range(10))  # the class names of the shipped tags' weights
ARGS = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2)


def _create(model_cls: type, variant: str, pretrained: bool, **kwargs) -> torch.nn.Module:
    """What the families' ``_create_vit_*`` do."""
    return build_vit(model_cls, variant, pretrained, checkpoint_filter_fn, **dict(ARGS, out_indices=1, **kwargs))


def buildertest_hyperbf(pretrained: bool = False, **kwargs) -> VisionTransformerHyperBF:
    return _create(VisionTransformerHyperBF, HYPERBF, pretrained, **kwargs)


def buildertest_qimia(pretrained: bool = False, **kwargs) -> VisionTransformerQimia:
    return _create(VisionTransformerQimia, QIMIA, pretrained, **dict(dict(key_dim=16), **kwargs))


def buildertest_untrained(pretrained: bool = False, **kwargs) -> VisionTransformerHyperBF:
    return _create(VisionTransformerHyperBF, UNTRAINED, pretrained, **kwargs)


def _cfg(**kwargs) -> dict:
    return dict(num_classes=10, input_size=(3, 32, 32), fixed_input_size=True, first_conv='patch_embed.proj',
                classifier='head', **kwargs)


@pytest.fixture(scope='module')
def shipped(tmp_path_factory) -> Dict[str, Path]:
    """The weights files of the registered models' default tags, as the package ships them: bf16 safetensors."""
    folder = tmp_path_factory.mktemp('weights')
    files = {name: folder / f'{name}.shipped.safetensors' for name in (HYPERBF, QIMIA)}
    module = sys.modules[__name__]
    # timm reads the cfgs of a model from its module when the model registers
    module.default_cfgs = generate_default_cfgs({
        **{f'{name}.shipped': _cfg(file=str(file), label_names=LABELS) for name, file in files.items()},
        f'{HYPERBF}.missing': _cfg(file=str(folder / 'not-installed.safetensors')),
        f'{HYPERBF}.untrained': _cfg(),
        f'{UNTRAINED}.untrained': _cfg(),
    })
    for entrypoint in (buildertest_hyperbf, buildertest_qimia, buildertest_untrained):
        register_model(entrypoint)
    for name, file in files.items():
        torch.manual_seed(0)
        model = timm.create_model(name)
        save_file({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}, file)
    return files


def weights(name: str, **kwargs) -> Dict[str, torch.Tensor]:
    """The state dict of a new random ``name`` model."""
    torch.manual_seed(1)
    return timm.create_model(name, **kwargs).state_dict()


def load_error(file: Path, name: str = HYPERBF, **kwargs) -> str:
    """The message of the error that loading ``file`` as the weights of ``name`` raises."""
    with pytest.raises(PretrainedWeightsError) as e:
        timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(file)), **kwargs)
    return str(e.value)


def assert_loaded(model: torch.nn.Module, state_dict: Dict[str, torch.Tensor], but: tuple = ()) -> None:
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], v.float()) for k, v in state_dict.items() if k not in but)


# --- weights that load ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize('name', [HYPERBF, QIMIA])
def test_pretrained_loads_the_bf16_file_of_the_default_tag_into_float32(shipped, name):
    model = timm.create_model(name, pretrained=True)
    assert {v.dtype for v in model.state_dict().values()} == {torch.float32}
    assert_loaded(model, load_file(shipped[name]))
    assert model.pretrained_cfg['tag'] == 'shipped' and model.pretrained_cfg['file'] == str(shipped[name])
    assert 'state_dict' not in model.pretrained_cfg  # the weights were handed to timm in memory, and not kept there
    assert timm.list_pretrained('buildertest_*') == [f'{HYPERBF}.missing', f'{HYPERBF}.shipped', f'{QIMIA}.shipped']


@pytest.mark.parametrize('num_classes, overlay', [(5, {}), (0, {}), (4, dict(num_classes=-1))],
                         ids=['classes', 'no_head', 'train_py_pretrained_path'])  # train.py's overlay forces a new head
def test_a_new_num_classes_resets_the_head_and_loads_the_rest(shipped, num_classes, overlay):
    model = timm.create_model(HYPERBF, pretrained=True, num_classes=num_classes,
                              pretrained_cfg_overlay=overlay and dict(overlay, file=str(shipped[HYPERBF])))
    assert model.num_classes == num_classes and model(torch.randn(1, 3, 32, 32)).shape[-1] == (num_classes or 32)
    assert_loaded(model, load_file(shipped[HYPERBF]), but=('head.weight', 'head.bias'))


def test_features_only_loads_the_weights_and_keeps_no_copy_of_them(shipped):
    features = timm.create_model(HYPERBF, pretrained=True, features_only=True)
    state_dict = {f'model.{k}': v for k, v in load_file(shipped[HYPERBF]).items() if k.startswith('blocks.0.')}
    assert_loaded(features, state_dict)
    assert not [m for m in features.modules() if 'state_dict' in (getattr(m, 'pretrained_cfg', None) or {})]


def test_a_checkpoint_of_train_py_loads_its_ema_weights_as_timm_does(shipped, tmp_path):
    state_dict = weights(HYPERBF)
    ema = {k: v + 1 for k, v in state_dict.items()}
    torch.save({'epoch': 3, 'arch': HYPERBF, 'args': argparse.Namespace(model=HYPERBF), 'state_dict': state_dict,
                'state_dict_ema': ema}, tmp_path / 'last.pth.tar')
    overlay = dict(file=str(tmp_path / 'last.pth.tar'))
    model = timm.create_model(HYPERBF, pretrained=True, pretrained_cfg_overlay=overlay)
    assert_loaded(model, ema)


@pytest.mark.parametrize('file', ['weights.pth', 'weights.safetensors'])
def test_own_weights_load_as_timm_loads_them(shipped, tmp_path, file):
    """A file of another number of classes than the cfg's needs it named (model and cfg), and the error says so."""
    save = torch.save if file.endswith('.pth') else save_file
    save(weights(HYPERBF), tmp_path / file)
    assert_loaded(timm.create_model(HYPERBF, pretrained=True, pretrained_cfg_overlay=dict(file=str(tmp_path / file))),
                  load_file(tmp_path / file) if file.endswith('.safetensors') else torch.load(tmp_path / file))
    state_dict = weights(HYPERBF, num_classes=7)
    save(state_dict, tmp_path / file)
    assert 'num_classes=7' in load_error(tmp_path / file)
    model = timm.create_model(HYPERBF, pretrained=True, num_classes=7,
                              pretrained_cfg_overlay=dict(file=str(tmp_path / file), num_classes=7))
    assert_loaded(model, state_dict)


@pytest.mark.parametrize('name', [HYPERBF, QIMIA])
def test_timm_adapts_the_stem_to_in_chans(shipped, name):
    model = timm.create_model(name, pretrained=True, in_chans=1)
    stem = load_file(shipped[name])['patch_embed.proj.weight']  # bf16, summed as timm sums it
    torch.testing.assert_close(model.patch_embed.proj.weight, stem.sum(1, keepdim=True).float())
    assert_loaded(model, load_file(shipped[name]), but=('patch_embed.proj.weight',))


def test_the_tags_class_names_go_with_its_weights_only(shipped, tmp_path):
    """A tag's class names describe its weights: another number of classes, or own weights without names, has none."""
    def names(**kwargs):
        names = timm.create_model(HYPERBF, **kwargs).pretrained_cfg.get('label_names')
        return None if names is None else tuple(names)

    assert names(pretrained=True) == names() == LABELS
    assert names(pretrained=True, num_classes=5) is None and names(num_classes=5) is None
    own = tmp_path / 'own.safetensors'
    save_file(weights(HYPERBF), own)
    assert names(pretrained=True, pretrained_cfg_overlay=dict(file=str(own))) is None
    assert names(pretrained=True, pretrained_cfg_overlay=dict(file=str(own), label_names=tuple('abcdefghij'))) == \
        tuple('abcdefghij')


def test_pretrained_strict_false_loads_weights_that_lack_entries_and_leaves_those_as_initialised(shipped, tmp_path):
    """timm's ``pretrained_strict=False`` takes weights of part of the model; without it, what they lack is named."""
    trained = weights(HYPERBF)
    state_dict = {k: v for k, v in trained.items() if not k.startswith('blocks.1.')}
    save_file(state_dict, tmp_path / 'partial.safetensors')
    message = load_error(tmp_path / 'partial.safetensors')
    assert message.startswith(f'{tmp_path}/partial.safetensors does not fit {HYPERBF} as built: ')
    assert ' missing (blocks.1.norm1.weight, ' in message and 'unexpected' not in message
    torch.manual_seed(2)
    initialised = timm.create_model(HYPERBF).state_dict()
    torch.manual_seed(2)
    model = timm.create_model(HYPERBF, pretrained=True, pretrained_strict=False,
                              pretrained_cfg_overlay=dict(file=str(tmp_path / 'partial.safetensors')))
    assert_loaded(model, state_dict)
    lacking = {k: v for k, v in initialised.items() if k not in state_dict}
    assert lacking and all(k.startswith('blocks.1.') for k in lacking)
    assert_loaded(model, lacking)
    assert not all(torch.equal(v, trained[k]) for k, v in lacking.items())  # initialised otherwise than trained


# --- tags and files: the error names the tag or file, the fault and the fix ---------------------------------------

def test_pretrained_for_a_tag_without_weights_names_the_tags_with_weights(shipped):
    for name in (f'{HYPERBF}.untrained', UNTRAINED):
        with pytest.raises(PretrainedWeightsError) as e:
            timm.create_model(name, pretrained=True)
        assert 'untrained has no weights' in str(e.value) and 'pretrained=False' in str(e.value)
    assert f'Tags with weights: {HYPERBF}.shipped, {HYPERBF}.missing;' in str(
        pytest.raises(PretrainedWeightsError, timm.create_model, f'{HYPERBF}.untrained', pretrained=True).value)
    assert timm.create_model(f'{HYPERBF}.untrained').pretrained_cfg['tag'] == 'untrained'


@pytest.mark.parametrize('pretrained', [True, False])
def test_an_unknown_tag_is_named_with_the_tags_there_are(shipped, pretrained):
    message = f"{HYPERBF} has no pretrained tag 'nonexistent'. Tags with weights: {HYPERBF}.shipped"
    with pytest.raises(PretrainedWeightsError, match=message):
        timm.create_model(f'{HYPERBF}.nonexistent', pretrained=pretrained)
    with pytest.raises(PretrainedWeightsError, match=message):
        timm.create_model(HYPERBF, pretrained=pretrained, pretrained_cfg='nonexistent')


def test_a_missing_file_or_a_folder_is_named(shipped, tmp_path):
    assert 'not-installed.safetensors is no weights file (missing)' in str(
        pytest.raises(PretrainedWeightsError, timm.create_model, f'{HYPERBF}.missing', pretrained=True).value)
    assert load_error(tmp_path / 'nope.pth').startswith(f'{tmp_path}/nope.pth is no weights file (missing)')
    assert load_error(tmp_path).startswith(f'{tmp_path} is no weights file (a folder)')


class Payload:
    def __reduce__(self):
        return exec, ("open(__import__('os').environ['PAYLOAD_MARK'], 'w').close()",)


@pytest.mark.parametrize('name, content', [
    ('empty.safetensors', lambda shipped, tmp: b''),
    ('cut.safetensors', lambda shipped, tmp: shipped.read_bytes()[:-8]),
    ('cut.pth.tar', lambda shipped, tmp: (tmp / 'full.pth').read_bytes()[:-100]),
    ('torch.safetensors', lambda shipped, tmp: (tmp / 'full.pth').read_bytes()),
    ('text.pth', lambda shipped, tmp: b'model weights go here\n'),
    ('code.pth', lambda shipped, tmp: (tmp / 'code.pth').read_bytes()),
])
def test_a_file_that_cannot_be_read_is_named_and_no_code_in_it_runs(shipped, tmp_path, monkeypatch, name, content):
    monkeypatch.setenv('PAYLOAD_MARK', str(tmp_path / 'payload-ran'))
    torch.save(weights(HYPERBF), tmp_path / 'full.pth')
    torch.save({'state_dict': weights(HYPERBF), 'extra': Payload()}, tmp_path / 'code.pth')
    (tmp_path / name).write_bytes(content(shipped[HYPERBF], tmp_path))
    message = load_error(tmp_path / name)
    assert message.startswith(f'{tmp_path}/{name} cannot be read as weights (') and 'state_dict()' in message
    assert not (tmp_path / 'payload-ran').exists()


def test_a_file_without_weights_says_so(shipped, tmp_path):
    torch.save({'notes': 'hello'}, tmp_path / 'w.pth')
    assert load_error(tmp_path / 'w.pth').startswith(f'{tmp_path}/w.pth holds no weights')


# --- weights of another architecture: what differs, and the argument that fits them -------------------------------

def test_a_checkpoint_of_the_other_family_names_what_differs(shipped, tmp_path):
    torch.save({'arch': QIMIA, 'state_dict': weights(QIMIA)}, tmp_path / 'qimia.pth.tar')
    message = load_error(tmp_path / 'qimia.pth.tar')
    assert message.startswith(f'{tmp_path}/qimia.pth.tar does not fit {HYPERBF} as built: ')
    assert ' missing (' in message and ' unexpected (' in message and '--model-kwargs' in message


@pytest.mark.parametrize('kwargs, named', [
    (dict(depth=1, embed_dim=48), ['of another shape (cls_token (1, 1, 48) for (1, 1, 32)', 'embed_dim=48']),
    (dict(depth=3), ['unexpected (blocks.2.', 'have 3 blocks']),
    (dict(init_values=1e-5), ['init_values']),
])
def test_weights_of_another_shape_name_the_argument_that_fits_them(shipped, tmp_path, kwargs, named):
    save_file(weights(HYPERBF, **kwargs), tmp_path / 'w.safetensors')
    message = load_error(tmp_path / 'w.safetensors')
    assert all(part in message for part in named), message


@pytest.mark.parametrize('name', [HYPERBF, QIMIA])
def test_weights_with_other_prefix_tokens_name_the_model_arguments_that_fit_them(shipped, tmp_path, name):
    trained_as = dict(reg_tokens=2, class_token=False, global_pool='avg')
    message = str(pytest.raises(PretrainedWeightsError, timm.create_model, name, pretrained=True, **trained_as).value)
    assert 'class_token=True, reg_tokens=0' in message
    state_dict = weights(name, **trained_as)
    save_file(state_dict, tmp_path / 'registers.safetensors')
    assert 'class_token=False, reg_tokens=2' in load_error(tmp_path / 'registers.safetensors', name)
    model = timm.create_model(name, pretrained=True, **trained_as,
                              pretrained_cfg_overlay=dict(file=str(tmp_path / 'registers.safetensors')))
    assert_loaded(model, state_dict)


def test_average_pooling_loads_with_the_norm_the_weights_pool_after(shipped):
    """timm's ViT with ``global_pool='avg'`` norms after the pooling (``fc_norm``), a layer the weights lack."""
    assert 'fc_norm=False' in str(pytest.raises(PretrainedWeightsError, timm.create_model, HYPERBF, pretrained=True,
                                                global_pool='avg').value)
    model = timm.create_model(HYPERBF, pretrained=True, global_pool='avg', fc_norm=False)
    assert_loaded(model, load_file(shipped[HYPERBF]))
