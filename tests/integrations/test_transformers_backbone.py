"""transformers' ``TimmBackbone`` (the timm backbone of its detection and segmentation models, ``use_timm_backbone``)
on both families: ``TimmBackbone.from_pretrained`` with the name of one of our models loads its pretrained weights
and gives the feature maps of the model's ``features_only`` form on real CIFAR-10 images."""
import pytest
import timm
import torch

from .conftest import cifar10_batch

transformers = pytest.importorskip('transformers', reason='transformers is a test extra: pip install -e ".[test]"')

MODELS = ['vit_hyperbf_tiny', 'vit_qimia_tiny']  # with their shipped CIFAR-10 weights
OUT_INDICES = (3, 7, 11)


@pytest.mark.parametrize('name', MODELS)
def test_timm_backbone_gives_the_pretrained_feature_maps(name, cifar10_tiny):
    backbone = transformers.TimmBackbone.from_pretrained(name, out_indices=OUT_INDICES).eval()
    features = timm.create_model(name, pretrained=True, features_only=True, out_indices=OUT_INDICES).eval()
    images, _ = cifar10_batch(cifar10_tiny / 'test', features)

    assert backbone.channels == features.feature_info.channels() == [192] * 3
    with torch.no_grad():
        maps = backbone(images).feature_maps
        expected = features(images)
    assert [m.shape for m in maps] == [(len(images), 192, 8, 8)] * 3
    for got, want in zip(maps, expected):
        torch.testing.assert_close(got, want, rtol=0., atol=0.)
