"""Pretrained weights through ``build_vit``: a tag's weights file loads offline like timm's own weights, read by timm,
and every bad tag or weights file is an error that names it, says what is wrong and how to fix it.

The models here are small HyperBF and QIMIA ViTs registered by this module, whose default tag points at a bf16
safetensors file as the shipped weights will."""
import argparse
import pickle
import sys
from pathlib import Path
from typing import Dict

import pytest
import timm
import torch
from safetensors.torch import load_file, save_file
from timm.models import generate_default_cfgs, register_model
from timm.models.vision_transformer import checkpoint_filter_fn

from timm_hbf.models import PretrainedWeightsError, VisionTransformerHyperBF, VisionTransformerQimia, _builder
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


@pytest.mark.parametrize('num_classes', [5, 0])
def test_a_new_num_classes_resets_the_head_and_loads_the_rest(shipped, num_classes):
    model = timm.create_model(HYPERBF, pretrained=True, num_classes=num_classes)
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
def test_own_weights_load_with_their_number_of_classes_unless_another_is_asked(shipped, tmp_path, file):
    state_dict = weights(HYPERBF, num_classes=7)
    (torch.save if file.endswith('.pth') else save_file)(state_dict, tmp_path / file)
    overlay = dict(file=str(tmp_path / file))
    model = timm.create_model(HYPERBF, pretrained=True, pretrained_cfg_overlay=overlay)
    assert model.num_classes == 7 and model.pretrained_cfg['num_classes'] == 7
    assert_loaded(model, state_dict)
    model = timm.create_model(HYPERBF, pretrained=True, pretrained_cfg_overlay=overlay, num_classes=3)
    assert model.head.weight.shape == (3, 32)
    assert_loaded(model, state_dict, but=('head.weight', 'head.bias'))


@pytest.mark.parametrize('name', [HYPERBF, QIMIA])
def test_own_weights_load_with_their_input_channels_unless_others_are_asked(shipped, tmp_path, name):
    state_dict = weights(name, in_chans=1)
    torch.save(state_dict, tmp_path / 'gray.pth')
    overlay = dict(file=str(tmp_path / 'gray.pth'))
    model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay)
    assert model.patch_embed.proj.in_channels == 1 and model.pretrained_cfg['input_size'][0] == 1
    assert_loaded(model, state_dict)
    if not _builder.ADAPTS_ANY_CHANNELS:  # timm before 1.0.31 adapts only 3-channel weights
        with pytest.raises(PretrainedWeightsError, match='1-channel input weights.*in_chans=1, or upgrade timm'):
            timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, in_chans=3)
        return
    model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, in_chans=3)  # timm adapts
    stem = state_dict['patch_embed.proj.weight']
    torch.testing.assert_close(model.patch_embed.proj.weight, stem.repeat(1, 3, 1, 1) / 3)
    assert_loaded(model, state_dict, but=('patch_embed.proj.weight',))


def test_where_timm_adapts_only_rgb_weights_others_raise_but_any_into_gray(shipped, tmp_path, monkeypatch):
    """timm before 1.0.31 adapts only 3-channel input weights, and sums any into 1 channel: it re-initialises the
    input layer of others (a warning in the log) or refuses them."""
    monkeypatch.setattr(_builder, 'ADAPTS_ANY_CHANNELS', False)
    for weights_chans, model_chans in ((2, 2), (2, 3), (1, 3), (1, 2)):
        path = tmp_path / f'{weights_chans}.pth'
        torch.save(weights(HYPERBF, in_chans=weights_chans), path)
        assert load_error(path, in_chans=model_chans) == (
            f'{path} has {weights_chans}-channel input weights (patch_embed.proj) and {HYPERBF} is built for '
            f'{model_chans}: timm before 1.0.31 adapts only 3-channel input weights (and any into 1 channel), and '
            'would re-initialise or refuse these. Create the model with in_chans=1, or upgrade timm to 1.0.31 or '
            'newer, which adapts any number.')
    for weights_chans in (1, 2):
        gray = weights(HYPERBF, in_chans=weights_chans)
        torch.save(gray, tmp_path / 'gray.pth')
        model = timm.create_model(HYPERBF, pretrained=True, in_chans=1,
                                  pretrained_cfg_overlay=dict(file=str(tmp_path / 'gray.pth')))
        assert_loaded(model, gray, but=('patch_embed.proj.weight',))
        torch.testing.assert_close(model.patch_embed.proj.weight, gray['patch_embed.proj.weight'].sum(1, True))


def test_train_py_pretrained_path_loads_all_but_the_head(shipped):
    """train.py --pretrained --pretrained-path FILE --num-classes 4: its overlay forces a new head."""
    overlay = dict(file=str(shipped[HYPERBF]), num_classes=-1)
    model = timm.create_model(HYPERBF, pretrained=True, pretrained_cfg_overlay=overlay, num_classes=4)
    assert model.num_classes == 4
    assert_loaded(model, load_file(shipped[HYPERBF]), but=('head.weight', 'head.bias'))


def test_the_tags_class_names_go_with_its_weights_only(shipped, tmp_path):
    """A tag's class names (which timm's inference.py prints) describe its weights: a model with another number of
    classes, or given weights of one's own without names, has none."""
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


# --- tags -----------------------------------------------------------------------------------------------------------

def test_pretrained_for_a_tag_without_weights_names_it_the_tags_with_weights_and_how_to_load_ones_own(shipped):
    with pytest.raises(PretrainedWeightsError) as e:
        timm.create_model(f'{HYPERBF}.untrained', pretrained=True)
    assert str(e.value) == (
        f'{HYPERBF}.untrained has no pretrained weights. Tags with weights: {HYPERBF}.shipped, {HYPERBF}.missing; '
        f'without: {HYPERBF}.untrained. pretrained_cfg_overlay=dict(file=PATH) loads your own (a checkpoint '
        "of train.py, or a state dict in a .pth or .safetensors file; in timm's train.py --pretrained-path PATH, in "
        "validate.py --checkpoint PATH); 'hf-hub:ORG/NAME' as the model name loads a Hugging Face Hub repo. Or create "
        "it with pretrained=False (in timm's scripts, without --pretrained).")
    assert timm.create_model(f'{HYPERBF}.untrained').pretrained_cfg['tag'] == 'untrained'


def test_pretrained_for_a_model_without_any_weights_says_so(shipped):
    with pytest.raises(PretrainedWeightsError) as e:
        timm.create_model(UNTRAINED, pretrained=True)
    assert str(e.value).startswith(f'{UNTRAINED}.untrained has no pretrained weights. No tag of {UNTRAINED} has '
                                   f'weights yet (its tags: {UNTRAINED}.untrained). pretrained_cfg_overlay=dict(')


@pytest.mark.parametrize('pretrained', [True, False])
def test_an_unknown_tag_is_named_with_the_tags_there_are(shipped, pretrained):
    message = (f"^{HYPERBF} has no pretrained tag 'nonexistent'. Tags with weights: {HYPERBF}.shipped, "
               fr'{HYPERBF}.missing; without: {HYPERBF}.untrained. pretrained_cfg_overlay=dict\(file=PATH\) loads')
    with pytest.raises(PretrainedWeightsError, match=message):
        timm.create_model(f'{HYPERBF}.nonexistent', pretrained=pretrained)
    with pytest.raises(PretrainedWeightsError, match=message):
        timm.create_model(HYPERBF, pretrained=pretrained, pretrained_cfg='nonexistent')


def test_the_missing_file_of_a_shipped_tag_says_to_reinstall(shipped):
    with pytest.raises(PretrainedWeightsError) as e:
        timm.create_model(f'{HYPERBF}.missing', pretrained=True)
    assert str(e.value) == (
        f'The weights of {HYPERBF}.missing ship with timm-hbf as {shipped[HYPERBF].parent}/not-installed.safetensors, '
        'which is missing: the installation is incomplete. Reinstall timm-hbf (pip install --force-reinstall '
        '--no-deps timm-hbf).')


# --- bad weights files: timm reads them, the error names the file, the fault and the fix ---------------------------

def test_a_missing_weights_file_or_a_folder_is_named(shipped, tmp_path):
    assert load_error(tmp_path / 'nope.pth') == f'{tmp_path}/nope.pth does not exist. Name the weights file.'
    assert load_error(tmp_path) == f'{tmp_path} is a folder, not a weights file. Name the weights file.'


def _truncated_pth(tmp_path: Path) -> bytes:
    torch.save({'state_dict': weights(HYPERBF)}, tmp_path / 'full.pth')
    return (tmp_path / 'full.pth').read_bytes()[:-100]


@pytest.mark.parametrize('name, content, detail', [
    ('empty.safetensors', lambda shipped, tmp: b'', 'SafetensorError: Error while deserializing header: '),
    ('cut.safetensors', lambda shipped, tmp: shipped.read_bytes()[:-8], 'SafetensorError: Error while deserializing '),
    ('cut.pth.tar', lambda shipped, tmp: _truncated_pth(tmp), ''),
    ('torch.safetensors', lambda shipped, tmp: (tmp / 'full.pth').read_bytes(), 'SafetensorError: '),
    ('safetensors.pth', lambda shipped, tmp: shipped.read_bytes(), 'UnpicklingError: Unsupported operand '),
    ('text.pth', lambda shipped, tmp: b'model weights go here\n', 'UnpicklingError: Unsupported operand '),
    ('legacy.pth', lambda shipped, tmp: b'\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19.' + bytes(range(1, 256)),
     'UnpicklingError: Unsupported operand 1)'),
])
def test_a_file_that_cannot_be_read_says_so_without_blaming_python_objects(shipped, tmp_path, name, content, detail):
    """timm's own error for a pickle it cannot read blames globals it would not unpickle, and advises
    weights_only=False; the message names the file and what to do instead."""
    torch.save(weights(HYPERBF), tmp_path / 'full.pth')
    (tmp_path / name).write_bytes(content(shipped[HYPERBF], tmp_path))
    message = load_error(tmp_path / name)
    assert message.startswith(f'{tmp_path}/{name} cannot be read (') and detail in message
    assert message.endswith('): it is cut short, damaged, or not of the format its name says (.safetensors for '
                            'safetensors, any other for torch.save). Save or copy the weights again.')
    assert 'weights_only=False' not in message and 'globals' not in message


def test_a_file_without_weights_says_so(shipped, tmp_path):
    torch.save({'notes': 'hello'}, tmp_path / 'w.pth')
    assert load_error(tmp_path / 'w.pth') == (
        f'{tmp_path}/w.pth holds no weights: it is neither a checkpoint of train.py nor a state dict (names to '
        'tensors). Name the file that train.py or torch.save(model.state_dict(), PATH) wrote.')


class Payload:
    def __reduce__(self):
        return exec, ("open(__import__('os').environ['PAYLOAD_MARK'], 'w').close()",)


def test_a_pickle_with_code_is_refused_and_its_code_never_runs(shipped, tmp_path, monkeypatch):
    monkeypatch.setenv('PAYLOAD_MARK', str(tmp_path / 'payload-ran'))
    torch.save({'state_dict': weights(HYPERBF), 'extra': Payload()}, tmp_path / 'w.pth')
    assert load_error(tmp_path / 'w.pth') == (
        f'{tmp_path}/w.pth holds Python objects besides tensors (builtins.exec), which are not unpickled since that '
        'could run code. Save the state dict alone (model.state_dict()) with torch.save or '
        'safetensors.torch.save_file.')
    assert not (tmp_path / 'payload-ran').exists()
    pickle.loads(pickle.dumps(Payload()))  # the payload does run when unpickled unrestricted
    assert (tmp_path / 'payload-ran').exists()


def test_a_whole_pickled_model_says_to_save_its_state_dict(shipped, tmp_path):
    torch.save(timm.create_model(HYPERBF), tmp_path / 'model.pth')
    message = load_error(tmp_path / 'model.pth')
    assert message.startswith(f'{tmp_path}/model.pth holds Python objects besides tensors (')
    assert 'timm_hbf.models.vit_hyperbf.VisionTransformerHyperBF' in message and message.endswith(
        'Save the state dict alone (model.state_dict()) with torch.save or safetensors.torch.save_file.')


def test_a_checkpoint_of_the_other_family_says_what_differs(shipped, tmp_path):
    torch.save({'arch': QIMIA, 'state_dict': weights(QIMIA)}, tmp_path / 'qimia.pth.tar')
    message = load_error(tmp_path / 'qimia.pth.tar')
    assert message.startswith(f'{tmp_path}/qimia.pth.tar does not fit {HYPERBF} as built: ')
    assert ' missing (' in message and ' unexpected (' in message
    assert message.endswith('. Create the model the weights were trained as, with the same model arguments (those '
                            'of train.py --model and --model-kwargs).')
    save_file(weights(HYPERBF), tmp_path / 'hyperbf.safetensors')
    assert load_error(tmp_path / 'hyperbf.safetensors', QIMIA).startswith(
        f'{tmp_path}/hyperbf.safetensors does not fit {QIMIA} as built: ')


def test_weights_of_another_size_name_the_entries_that_differ(shipped, tmp_path):
    save_file(weights(HYPERBF, depth=1, embed_dim=48), tmp_path / 'w.safetensors')
    message = load_error(tmp_path / 'w.safetensors')
    assert message.startswith(f'{tmp_path}/w.safetensors does not fit {HYPERBF} as built: ')
    assert ' missing (blocks.1.norm1.weight, ' in message
    assert ' of another shape (cls_token (1, 1, 48) for (1, 1, 32), pos_embed (1, 17, 48) for (1, 17, 32), ' in message
    assert message.endswith('. The weights are 48 wide, the model 32: create the model of their width (embed_dim).')


@pytest.mark.parametrize('kwargs, named', [
    (dict(depth=3), 'The weights have 3 blocks, the model 2: create it with their depth.'),
    (dict(init_values=1e-5), 'The weights have layer scale (ls1, ls2): create the model with init_values'),
])
def test_weights_of_another_depth_or_block_name_the_argument_that_fits_them(shipped, tmp_path, kwargs, named):
    save_file(weights(HYPERBF, **dict(dict(depth=2), **kwargs)), tmp_path / 'w.safetensors')
    assert named in load_error(tmp_path / 'w.safetensors', depth=2)


@pytest.mark.parametrize('name', [HYPERBF, QIMIA])
@pytest.mark.parametrize('kwargs, built', [
    (dict(reg_tokens=4), 'a class token and 4 register tokens'),
    (dict(class_token=False, global_pool='avg'), 'no class token and 0 register tokens'),
])
def test_weights_with_other_prefix_tokens_name_the_model_arguments_that_fit_them(shipped, name, kwargs, built):
    with pytest.raises(PretrainedWeightsError) as e:
        timm.create_model(name, pretrained=True, **kwargs)
    assert str(e.value) == (
        f'{shipped[name]} does not fit {name} as built: the weights have a class token and 0 register tokens, the '
        f'model {built}. Create the model with class_token=True and reg_tokens=0, as the weights were trained.')


@pytest.mark.parametrize('name', [HYPERBF, QIMIA])
def test_weights_with_register_tokens_load_into_a_model_built_with_them(shipped, tmp_path, name):
    trained_as = dict(reg_tokens=2, class_token=False, global_pool='avg')
    state_dict = weights(name, **trained_as)
    save_file(state_dict, tmp_path / 'registers.safetensors')
    assert load_error(tmp_path / 'registers.safetensors', name).endswith(
        "the weights have no class token and 2 register tokens, the model a class token and 0 register tokens. "
        "Create the model with class_token=False and reg_tokens=2 (and a global_pool other than 'token'), as the "
        "weights were trained.")
    model = timm.create_model(name, pretrained=True, **trained_as,
                              pretrained_cfg_overlay=dict(file=str(tmp_path / 'registers.safetensors')))
    assert_loaded(model, state_dict)


def test_average_pooling_says_to_keep_the_norm_the_weights_pool_after(shipped):
    """timm's ViT with ``global_pool='avg'`` norms after the pooling (``fc_norm``), a layer the weights lack."""
    with pytest.raises(PretrainedWeightsError) as e:
        timm.create_model(HYPERBF, pretrained=True, global_pool='avg')
    assert str(e.value) == (
        f'{shipped[HYPERBF]} does not fit {HYPERBF} as built: 2 missing (fc_norm.weight, fc_norm.bias); 2 unexpected '
        "(norm.bias, norm.weight). The weights norm the tokens before the pooling (norm), the model after it "
        "(fc_norm, timm's ViT default with global_pool 'avg', 'max' or 'avgmax'): pass fc_norm=False to pool the "
        'tokens as the weights were trained to.')
    model = timm.create_model(HYPERBF, pretrained=True, global_pool='avg', fc_norm=False)
    assert model.global_pool == 'avg'
    assert_loaded(model, load_file(shipped[HYPERBF]))
