"""The weights in the wheel (``timm_hbf/weights/MODEL.TAG.safetensors``), one bf16 file per model, its default tag:
each loads offline with ``pretrained=True`` and classifies the repository's CIFAR-10 sample as when it was made, also
compiled and exported."""
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import load_file
from timm.data import ImageDataset, create_transform, resolve_data_config

import timm_hbf
from tests.helpers import EXECUTION_MODES, run_as

WEIGHTS = Path(timm_hbf.__file__).parent / 'weights'
# MODEL.TAG: how many of the sample's 200 test images the weights classify correctly (counted when they were made,
# with examples/classify_cifar10.py; float32 model, timm's eval transform)
SHIPPED = {
    'vit_attnres_block_tiny.cifar10_short': 140,
    'vit_attnres_tiny.cifar10_30ep': 146,
    'vit_hyperbf_nrbf_tiny.cifar10_100ep': 144,
    'vit_hyperbf_tiny.cifar10_100ep': 136,
    'vit_qimia_tiny.cifar10_30ep': 154,
}


def sample(model, cifar10_sample):
    """The sample's 200 test images through the model's eval transform (timm's), and their labels."""
    test = ImageDataset(str(cifar10_sample / 'test'), transform=create_transform(**resolve_data_config(model=model)))
    return map(torch.stack, zip(*((image, torch.tensor(label)) for image, label in test)))


def test_the_weights_with_a_tag_are_the_files_that_ship_one_per_model_its_default_tag_bf16_under_16_mb():
    with_weights = timm.list_models(module=['vit_hyperbf', 'vit_qimia', 'vit_attnres'], pretrained=True)
    assert [name for name in with_weights if timm.models.get_pretrained_cfg(name).file] == sorted(SHIPPED)
    assert sorted(path.name for path in WEIGHTS.iterdir()) == sorted(f'{name}.safetensors' for name in SHIPPED)
    for name in SHIPPED:
        arch, tag = name.split('.')
        path = WEIGHTS / f'{name}.safetensors'
        assert timm.create_model(arch, device='meta').pretrained_cfg['tag'] == tag
        assert timm.models.get_pretrained_cfg(name).file == str(path) and path.stat().st_size < 16e6
        assert all(tensor.dtype == (torch.float32 if key.endswith('.log_gamma') else torch.bfloat16)  # the widths
                   for key, tensor in load_file(path).items()), name


@pytest.mark.parametrize('name', SHIPPED)
def test_each_loads_offline_names_its_classes_and_classifies_the_sample_as_when_made(name, cifar10_sample,
                                                                                     monkeypatch):
    monkeypatch.setenv('HF_HUB_OFFLINE', '1')
    model = timm.create_model(name, pretrained=True).eval()
    # label i is the i-th class folder, sorted, as timm's ImageDataset numbers them
    assert list(model.pretrained_cfg['label_names']) == sorted(p.name for p in (cifar10_sample / 'test').iterdir())
    shipped = load_file(WEIGHTS / f'{name}.safetensors')
    assert model.state_dict().keys() == shipped.keys()
    assert all(torch.equal(value, shipped[key].float()) for key, value in model.state_dict().items())
    images, labels = sample(model, cifar10_sample)
    with torch.no_grad():
        assert (model(images).argmax(-1) == labels).sum().item() == SHIPPED[name]


@pytest.mark.slow
@pytest.mark.parametrize('mode', EXECUTION_MODES)
@pytest.mark.parametrize('name', [name for name in SHIPPED if 'qimia' in name or 'attnres' in name])
def test_depth_attention_weights_classify_the_sample_alike_in_every_execution_mode(name, mode, cifar10_sample):
    """Compiled with inductor whole, by region (a block at a time, as PyTorch's regional compilation does) or past a
    graph break, and exported: the eager logits within 1e-4, and as many images right."""
    torch._dynamo.reset()
    model = timm.create_model(name, pretrained=True).eval()
    images, labels = sample(model, cifar10_sample)
    with torch.no_grad():
        expected = model(images)
        got = run_as(mode, model, images)(images)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    assert (got.argmax(-1) == labels).sum().item() == SHIPPED[name]
