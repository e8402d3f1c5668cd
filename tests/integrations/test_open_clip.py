"""OpenCLIP's timm image tower on both families: a CLIP model built by OpenCLIP from a config naming one of our
pretrained models computes that model's features, trains contrastively on real CIFAR-10 images, locks as LiT locks it
(by the model's ``group_matcher``) and gives OpenCLIP's intermediates."""
import copy
import json
from pathlib import Path
from typing import Tuple

import pytest
import timm
import torch
from torch import nn

from timm_hbf.models import PretrainedWeightsError

from .conftest import cifar10_batch

open_clip = pytest.importorskip('open_clip', reason='open_clip_torch is a test extra: pip install -e ".[test]"')

MODELS = ['vit_hyperbf_tiny', 'vit_qimia_tiny']  # with their shipped CIFAR-10 weights
EMBED_DIM = 32
CAPTIONS = ['a photo of an airplane', 'a photo of a frog', 'a photo of a ship', 'a photo of a truck']


def build(name: str, folder: Path, **vision_cfg) -> nn.Module:
    """The CLIP model of an OpenCLIP config in ``folder`` (``local-dir:``) that names ``name`` as the image tower,
    with its pretrained weights (``pretrained_image``), and a small text tower."""
    data = timm.get_pretrained_cfg(name)
    config = dict(
        model_cfg=dict(
            embed_dim=EMBED_DIM,
            vision_cfg=dict(timm_model_name=name, image_size=32, **vision_cfg),
            text_cfg=dict(context_length=16, vocab_size=49408, width=32, heads=2, layers=1),
        ),
        preprocess_cfg=dict(mean=list(data.mean), std=list(data.std)),
    )
    (folder / 'open_clip_config.json').write_text(json.dumps(config))
    torch.manual_seed(0)
    return open_clip.create_model(f'local-dir:{folder}', pretrained_image=True, output_dict=True)


@pytest.fixture(scope='module', params=MODELS)
def clip(request, tmp_path_factory) -> Tuple[nn.Module, torch.Tensor]:
    """A CLIP model with one of our models as the image tower, OpenCLIP's default average pooling and linear
    projection (:func:`build`), and the tokenised captions. Tests that train it train a copy."""
    folder = tmp_path_factory.mktemp('open_clip_config')
    return build(request.param, folder), open_clip.get_tokenizer(f'local-dir:{folder}')(CAPTIONS)


def contrastive_step(model: nn.Module, images: torch.Tensor, text: torch.Tensor) -> None:
    """One SGD step of OpenCLIP's contrastive loss on what is trainable."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model.train()
    features = model(images, text)
    open_clip.ClipLoss()(features['image_features'], features['text_features'], features['logit_scale']).backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.fixture(scope='module')
def batch(cifar10_tiny) -> torch.Tensor:
    """The first image of four classes: airplane, frog, ship, truck."""
    images, targets = cifar10_batch(cifar10_tiny / 'test', timm.create_model('vit_hyperbf_tiny'))
    return torch.stack([images[(targets == c).nonzero()[0, 0]] for c in (0, 6, 8, 9)])


def test_the_image_tower_is_the_pretrained_timm_model_with_its_intermediates(clip, batch):
    model = clip[0].eval()
    pretrained = timm.create_model(model.visual.trunk.default_cfg['architecture'], pretrained=True).eval()
    trunk = model.visual.trunk
    assert type(trunk) is type(pretrained)
    expected = {k: v for k, v in pretrained.state_dict().items() if not k.startswith('head.')}
    assert trunk.state_dict().keys() == expected.keys()
    assert all(torch.equal(v, expected[k]) for k, v in trunk.state_dict().items())
    with torch.no_grad():  # the mean of the final patch tokens, the class token left out
        tokens = pretrained.forward_features(batch)[:, pretrained.num_prefix_tokens:]
        torch.testing.assert_close(trunk(batch), tokens.mean(1), rtol=0., atol=1e-6)
        features = model.encode_image(batch, normalize=True)
        out = model.visual.forward_intermediates(batch, indices=[3, 11], output_extra_tokens=True)
        _, own = trunk.forward_intermediates(batch, indices=[3, 11], return_prefix_tokens=True)
    assert features.shape == (len(batch), EMBED_DIM)
    torch.testing.assert_close(features.norm(dim=-1), torch.ones(len(batch)))
    torch.testing.assert_close(out['image_features'], model.encode_image(batch))
    for got, (spatial, prefix) in zip(zip(out['image_intermediates'], out['image_intermediates_prefix']), own):
        assert torch.equal(got[0], spatial) and torch.equal(got[1], prefix)


def test_contrastive_training_reaches_every_tower_parameter_and_lit_locking_leaves_the_last_groups(clip, batch):
    model, text = copy.deepcopy(clip[0]), clip[1]
    before = {k: p.detach().clone() for k, p in model.visual.named_parameters()}
    contrastive_step(model, batch, text)
    unchanged = [k for k, p in model.visual.named_parameters() if torch.equal(p, before[k])]
    assert not unchanged, f'image-tower parameters the contrastive loss did not train: {unchanged}'

    model = copy.deepcopy(clip[0])
    model.lock_image_tower(unlocked_groups=2)  # the last two layers; the final norm (and output read) go with the last
    trunk = model.visual.trunk
    depth = len(trunk.blocks)
    trainable = {k for k, p in trunk.named_parameters() if p.requires_grad}
    assert trainable == {k for k, _ in trunk.named_parameters()
                         if k.startswith((f'blocks.{depth - 2}.', f'blocks.{depth - 1}.', 'norm.', 'read_out.'))}
    before = {k: p.detach().clone() for k, p in trunk.named_parameters()}
    contrastive_step(model, batch, text)
    moved = {k for k, p in trunk.named_parameters() if not torch.equal(p, before[k])}
    assert moved and moved <= trainable


def test_the_models_own_head_as_projection_takes_the_class_token_of_a_pretrained_hyperbf(tmp_path):
    """With ``timm_proj: ''`` OpenCLIP builds the tower with ``global_pool=timm_pool``: ``'avg'`` makes timm's ViT
    norm after the pooling (``fc_norm``), a layer the weights lack, and OpenCLIP cannot pass ``fc_norm=False``."""
    (tmp_path / 'avg').mkdir()
    with pytest.raises(PretrainedWeightsError, match='fc_norm=False'):
        build('vit_hyperbf_tiny', tmp_path / 'avg', timm_pool='avg', timm_proj='')
    (tmp_path / 'token').mkdir()
    model = build('vit_hyperbf_tiny', tmp_path / 'token', timm_pool='token', timm_proj='')
    assert model.visual.trunk.global_pool == 'token' and model.visual.trunk.head.out_features == EMBED_DIM
