"""Pretrained weights through ``build_model``: a tag's weights file loads offline like timm's own weights, and every
bad tag or weights file is an error that names it, says what is wrong and how to fix it.

The models here are small HyperBF and QIMIA ViTs registered by this module, whose default tag points at a bf16
safetensors file as the shipped weights will."""
import argparse
import pickle
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict

import pytest
import timm
import torch
from safetensors.torch import load_file, save_file
from timm.models import generate_default_cfgs, register_model
from timm.models.vision_transformer import checkpoint_filter_fn

from timm_hbf.models import PretrainedWeightsError, VisionTransformerHyperBF, VisionTransformerQimia, _builder
from timm_hbf.models._builder import build_model, read_checkpoint

HYPERBF, QIMIA, UNTRAINED = 'buildertest_hyperbf', 'buildertest_qimia', 'buildertest_untrained'
LABELS = tuple(f'class {i}' for i in range(10))  # the class names of the shipped tags' weights
ARGS = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2)


def _create(model_cls: type, variant: str, pretrained: bool, **kwargs) -> torch.nn.Module:
    """What the families' ``_create_vit_*`` do, through ``build_model``."""
    out_indices = kwargs.pop('out_indices', 1)
    return build_model(model_cls, variant, pretrained, pretrained_filter_fn=checkpoint_filter_fn,
                       feature_cfg=dict(out_indices=out_indices, feature_cls='getter'), **dict(ARGS, **kwargs))


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


def test_where_timm_adapts_only_rgb_weights_others_raise_but_gray_into_gray(shipped, tmp_path, monkeypatch):
    """timm before 1.0.31 adapts only 3-channel input weights: it re-initialises others (or refuses them)."""
    monkeypatch.setattr(_builder, 'ADAPTS_ANY_CHANNELS', False)
    for weights_chans, model_chans in ((2, 2), (2, 1), (2, 3), (1, 3), (1, 2)):
        path = tmp_path / f'{weights_chans}.pth'
        torch.save(weights(HYPERBF, in_chans=weights_chans), path)
        fix = 'Create the model with in_chans=1, or upgrade' if weights_chans == 1 else 'Upgrade'
        assert load_error(path, in_chans=model_chans) == (
            f'{path} has {weights_chans}-channel input weights (patch_embed.proj) and {HYPERBF} is built for '
            f'{model_chans}: timm before 1.0.31 adapts only 3-channel input weights (and loads 1-channel ones into a '
            f'1-channel model), and would re-initialise or refuse these. {fix} timm to 1.0.31 or newer, which adapts '
            'any number.')
    gray = weights(HYPERBF, in_chans=1)
    torch.save(gray, tmp_path / 'gray.pth')
    overlay = dict(file=str(tmp_path / 'gray.pth'))
    assert_loaded(timm.create_model(HYPERBF, pretrained=True, pretrained_cfg_overlay=overlay), gray)


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
        'which does not exist: the installation is incomplete. Reinstall timm-hbf (pip install --force-reinstall '
        '--no-deps timm-hbf).')


# --- bad weights files ----------------------------------------------------------------------------------------------

def test_a_missing_weights_file_is_named(shipped, tmp_path):
    assert load_error(tmp_path / 'nope.pth') == f'{tmp_path}/nope.pth does not exist. Check the path.'


def test_a_folder_given_as_weights_file_says_to_name_the_file_in_it(shipped, tmp_path):
    assert load_error(tmp_path) == f'{tmp_path} is a folder, not a weights file. Name the weights file in it.'


def test_an_empty_weights_file_says_it_is_empty(shipped, tmp_path):
    (tmp_path / 'w.safetensors').touch()
    assert load_error(tmp_path / 'w.safetensors') == (
        f'{tmp_path}/w.safetensors is empty. It was cut short while being written or copied. Save or copy the '
        'weights again.')


@pytest.mark.parametrize('keep, detail', [
    (5, 'holds only 5 bytes, too few for weights'),
    (100, 'is truncated (its header alone takes {header} bytes, the file has 100)'),
    (-8, 'is truncated (its header describes {size} bytes, the file has {cut})'),
])
def test_a_truncated_safetensors_file_says_it_is_truncated(shipped, tmp_path, keep, detail):
    data = shipped[HYPERBF].read_bytes()
    file = tmp_path / 'w.safetensors'
    file.write_bytes(data[:keep])
    detail = detail.format(header=8 + int.from_bytes(data[:8], 'little'), size=len(data), cut=len(data) - 8)
    assert load_error(file) == (
        f'{file} {detail}. It was cut short while being written or copied. Save or copy the weights again.')


def test_a_truncated_pth_says_it_is_truncated(shipped, tmp_path):
    torch.save(weights(HYPERBF), tmp_path / 'full.pth')
    (tmp_path / 'w.pth').write_bytes((tmp_path / 'full.pth').read_bytes()[:-100])
    assert load_error(tmp_path / 'w.pth') == (
        f'{tmp_path}/w.pth is truncated (its zip archive has no end). It was cut short while being written or '
        'copied. Save or copy the weights again.')


@pytest.mark.parametrize('header, problem', [
    ('{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}',
     "its safetensors header cannot be parsed (JSONDecodeError: Expecting ',' delimiter: "),
    ('{"w": {"dtype": "F32", "shape": [4]}}', "its safetensors header cannot be parsed (KeyError: 'data_offsets')"),
    ('{"w": {"dtype": "F32", "shape": [5], "data_offsets": [0, 16]}}',
     'safetensors cannot read it (SafetensorError: Error while deserializing header: '),
], ids=['not_json', 'entry_without_offsets', 'shape_beyond_offsets'])
def test_a_safetensors_file_with_a_damaged_header_says_it_is_damaged(shipped, tmp_path, header, problem):
    file = tmp_path / 'w.safetensors'
    file.write_bytes(len(header).to_bytes(8, 'little') + header.encode() + bytes(16))
    message = load_error(file)
    assert message.startswith(f'{file} is damaged: {problem}')
    assert message.endswith('). Save or copy the weights again.')


@pytest.mark.parametrize('name, damaged', [
    ('last.pth.tar', 'central directory'),  # the archive's list of its files, at its end
    ('weights.pth', 'local header'),  # the header of a file in the archive (torch.load reads .format_version first)
])
def test_a_pth_with_a_damaged_zip_archive_says_it_is_damaged(shipped, tmp_path, name, damaged):
    torch.save({'state_dict': weights(HYPERBF)}, tmp_path / 'full.pth')
    data = (tmp_path / 'full.pth').read_bytes()
    with zipfile.ZipFile(tmp_path / 'full.pth') as archive:
        member = next(m for m in archive.infolist() if m.filename.endswith('/.format_version'))
    at = data.rindex(b'PK\x01\x02') if damaged == 'central directory' else member.header_offset
    assert data[at:at + 2] == b'PK'
    (tmp_path / name).write_bytes(data[:at] + b'XXXX' + data[at + 4:])  # the zip signature there overwritten
    message = load_error(tmp_path / name)
    assert message.startswith(f'{tmp_path}/{name} is damaged: torch.load cannot read it (RuntimeError: '
                              'PytorchStreamReader failed reading ')
    assert 'archive is corrupted' in message and message.endswith('). Save or copy the weights again.')


def test_a_pth_named_safetensors_says_to_rename_it(shipped, tmp_path):
    torch.save(weights(HYPERBF), tmp_path / 'w.safetensors')
    assert load_error(tmp_path / 'w.safetensors') == (
        f'{tmp_path}/w.safetensors is a torch.save file, but its name says safetensors. Rename it to end in .pth.')


def test_a_safetensors_file_named_pth_says_to_rename_it(shipped, tmp_path):
    save_file(weights(HYPERBF), tmp_path / 'w.pth')
    assert load_error(tmp_path / 'w.pth') == (
        f'{tmp_path}/w.pth is a safetensors file, but its name says torch.save. Rename it to end in .safetensors.')


def test_a_text_file_says_it_is_neither_format(shipped, tmp_path):
    (tmp_path / 'w.pth').write_text('model weights go here\n')
    assert load_error(tmp_path / 'w.pth') == (
        f"{tmp_path}/w.pth is neither a safetensors file nor a torch.save checkpoint (it starts with b'model weights "
        "go'). Name a checkpoint of train.py, or weights saved by torch.save or safetensors.torch.save_file.")


def test_a_git_lfs_pointer_says_to_fetch_the_file(shipped, tmp_path):
    (tmp_path / 'w.safetensors').write_text('version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 9\n')
    assert load_error(tmp_path / 'w.safetensors') == (
        f'{tmp_path}/w.safetensors is a Git LFS pointer, not the weights. Fetch the file with `git lfs pull`.')


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
        f'{tmp_path}/w.pth holds Python objects besides tensors (exec among them). It is not unpickled any further, '
        'since that could run code: save the state dict alone (model.state_dict()) with torch.save or '
        'safetensors.torch.save_file.')
    assert not (tmp_path / 'payload-ran').exists()
    pickle.loads(pickle.dumps(Payload()))  # the payload does run when unpickled unrestricted
    assert (tmp_path / 'payload-ran').exists()


def test_a_whole_pickled_model_says_to_save_its_state_dict_and_never_to_unpickle_it(shipped, tmp_path):
    """torch's own advice (weights_only=False, add_safe_globals) would run the file's code: it is not passed on."""
    torch.save(timm.create_model(HYPERBF), tmp_path / 'model.pth')
    assert load_error(tmp_path / 'model.pth') == (
        f'{tmp_path}/model.pth holds Python objects besides tensors '
        '(timm_hbf.models.vit_hyperbf.VisionTransformerHyperBF among them). It is not unpickled any further, since '
        'that could run code: save the state dict alone (model.state_dict()) with torch.save or '
        'safetensors.torch.save_file.')


@pytest.mark.parametrize('name, data', [
    ('weights.pth', b'\x80\x02' + bytes(range(1, 256))),  # a pickle's first bytes, then no pickle at all
    ('legacy.pth', b'\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19.' + bytes(range(1, 256))),  # legacy's magic number
])
def test_a_pickle_of_random_bytes_says_it_is_damaged_not_that_it_holds_objects(shipped, tmp_path, name, data):
    (tmp_path / name).write_bytes(data)
    assert load_error(tmp_path / name) == (  # torch's error, without its advice to load with weights_only=False
        f'{tmp_path}/{name} is damaged: torch.load cannot read it (UnpicklingError: Unsupported operand 1). Save or '
        'copy the weights again.')


def test_a_checkpoint_of_the_other_family_says_what_differs_and_what_it_was_saved_from(shipped, tmp_path):
    torch.save({'arch': QIMIA, 'state_dict': weights(QIMIA)}, tmp_path / 'qimia.pth.tar')
    message = load_error(tmp_path / 'qimia.pth.tar')
    assert message.startswith(f'{tmp_path}/qimia.pth.tar does not fit {HYPERBF} as built: ')
    assert ' missing (' in message and ' unexpected (' in message
    assert message.endswith(f'. They were saved from a {QIMIA}. Create the model the weights were trained as, with '
                            'the same model arguments (those of train.py --model and --model-kwargs).')
    save_file(weights(HYPERBF), tmp_path / 'hyperbf.safetensors')
    assert load_error(tmp_path / 'hyperbf.safetensors', QIMIA).startswith(
        f'{tmp_path}/hyperbf.safetensors does not fit {QIMIA} as built: ')


def test_weights_of_another_size_name_the_entries_that_differ(shipped, tmp_path):
    save_file(weights(HYPERBF, depth=1, embed_dim=48), tmp_path / 'w.safetensors')
    message = load_error(tmp_path / 'w.safetensors')
    assert message.startswith(f'{tmp_path}/w.safetensors does not fit {HYPERBF} as built: ')
    assert ' missing (blocks.1.norm1.weight, ' in message
    assert ' of another shape (cls_token (1, 1, 48) for (1, 1, 32), pos_embed (1, 17, 48) for (1, 17, 32), ' in message
    assert message.endswith('. Create the model the weights were trained as, with the same model arguments (those of '
                            'train.py --model and --model-kwargs).')


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


def test_threads_reading_checkpoints_of_train_py_at_once_all_read_them(tmp_path):
    """The allowlist of ``argparse.Namespace`` is global to the process: one thread leaving it must not refuse the
    checkpoint another thread is reading (``benchmarks/accuracy.py`` reads its runs from a thread pool)."""
    path = tmp_path / 'model_best.pth.tar'
    torch.save({'epoch': 2, 'args': argparse.Namespace(model=HYPERBF), 'state_dict': {'w': torch.zeros(4096)}}, path)
    with ThreadPoolExecutor(8) as pool:
        epochs = list(pool.map(lambda _: read_checkpoint(path)['epoch'], range(400)))
    assert epochs == [2] * 400
