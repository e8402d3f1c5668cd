"""Attention Residuals on timm's ViT weights: every AttnRes architecture takes the weights of its timm ViT (a file,
load_state_dict, timm's Hub repositories) with zero queries, computes the ViT's function, and learns its queries from
there. The AttnRes read itself: tests/models/test_vit_qimia.py."""
import copy

import pytest
import timm
import torch
from safetensors.torch import save_file

import timm_hbf  # noqa: F401  (registers the models)
from tests.helpers import images
from timm_hbf.models import PretrainedWeightsError
from timm_hbf.models.vit_attnres import TIMM_WEIGHTS

CIFAR = dict(img_size=32, patch_size=4, num_classes=10)


def timm_counterpart(name: str) -> tuple:
    """The timm ViT whose weights an AttnRes architecture takes: its name and arguments."""
    arch = name.replace('vit_attnres_', '').replace('block_', '')
    if arch == 'tiny':
        return 'vit_tiny_patch16_224', CIFAR
    return next(iter(TIMM_WEIGHTS[arch].values())).split('.')[0], {}


def trained_like(model: torch.nn.Module) -> torch.nn.Module:
    """Random weights three times timm's init, a residual stream that its blocks' outputs change, and class and register
    tokens at unit scale, as trained ones are (timm starts them near zero, where LayerNorm's eps, 1e-6, would weigh
    against their variance; the reads' average divides it by up to 25^2)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.mul_(3.).add_(torch.randn_like(p) * .02)
            if name in ('cls_token', 'reg_token'):
                p.normal_()
    return model.eval()


def test_every_timm_vit_tag_names_timm_s_weights_of_that_architecture():
    archs = set(timm.list_models('vit_attnres*'))
    for arch, tags in TIMM_WEIGHTS.items():
        for kind in ('', 'block_'):
            name = f'vit_attnres_{kind}{arch}'
            assert name in archs
            for tag, weights in tags.items():
                cfg = timm.models.get_pretrained_cfg(f'{name}.{tag}')
                assert cfg.hf_hub_id == timm.models.get_pretrained_cfg(weights).hf_hub_id == f'timm/{weights}'
                assert cfg.mean == timm.models.get_pretrained_cfg(weights).mean


@pytest.mark.parametrize('name', [pytest.param(name, marks=pytest.mark.slow) if 'base' in name else name
                                  for name in timm.list_models('vit_attnres*')])
def test_every_architecture_computes_its_timm_vits_function_on_its_weights(name, tmp_path):
    """From a file, only the queries new (zero), and by ``load_state_dict``: the ViT's logits; a step moves queries."""
    vit_name, kwargs = timm_counterpart(name)
    vit = trained_like(timm.create_model(vit_name, **kwargs))
    save_file(vit.state_dict(), tmp_path / 'vit.safetensors')
    weights = dict(file=str(tmp_path / 'vit.safetensors'))  # what train.py --pretrained-path gives
    model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=weights, **kwargs).eval()
    new = set(model.state_dict()) - set(vit.state_dict())
    assert new and all(key.endswith('.query') for key in new) and set(vit.state_dict()) <= set(model.state_dict())
    assert all(not model.state_dict()[key].any() for key in new)
    x = images(size=vit.patch_embed.img_size[0])
    with torch.no_grad():
        expected = vit(x)
        assert expected.std() > 1  # logits of a scale that tells a wrong function apart
        plain = timm.create_model(name, **kwargs).eval()
        plain.load_state_dict(vit.state_dict())  # what train.py --initial-checkpoint does
        # float32: within 1e-3 of the largest logit (the ViT-B's streams reach a standard deviation of 50 here, whose
        # float32 rounding alone moves its logits by 3e-3); float64 and LayerNorm's eps at 0: the same function
        for got in (model(x), plain(x)):
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-3 * max(1., expected.abs().max().item()))
        exact = [copy.deepcopy(m).double() for m in (model, vit)]
        for norm in (m for net in exact for m in net.modules() if isinstance(m, torch.nn.LayerNorm)):
            norm.eps = 0.
        torch.testing.assert_close(*(net(x.double()) for net in exact), rtol=0, atol=1e-9)

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.nn.functional.cross_entropy(model(x), torch.tensor([0, 1])).backward()
    optimizer.step()
    assert all(p.abs().min() > 0 for n, p in model.named_parameters() if n.endswith('.query'))


def test_pretrained_loads_timm_s_hub_weights_through_timm_s_loader(tmp_path, monkeypatch):
    """A tag of timm's weights downloads them from timm's Hub repository (here a local file) and gives its logits."""
    vit = trained_like(timm.create_model('vit_tiny_patch16_224'))
    save_file(vit.state_dict(), tmp_path / 'model.safetensors')
    asked = []

    def download(repo_id, filename, **kwargs):
        asked.append((repo_id, filename))
        return str(tmp_path / 'model.safetensors')

    monkeypatch.setattr(timm.models._hub, 'hf_hub_download', download)
    model = timm.create_model('vit_attnres_tiny_patch16_224.augreg_in21k_ft_in1k', pretrained=True).eval()
    assert asked == [('timm/vit_tiny_patch16_224.augreg_in21k_ft_in1k', 'model.safetensors')]
    x = images(size=224)
    with torch.no_grad():
        torch.testing.assert_close(model(x), vit(x), rtol=0, atol=1e-3)


@pytest.mark.parametrize('vit_kwargs, name, names', [  # the other differences: tests/models/test_builder.py
    (dict(depth=6), 'vit_attnres_tiny', ['6 blocks, the model 12', 'depth']),  # the model's queries left aside
    (dict(class_token=False, global_pool='avg', fc_norm=False), 'vit_attnres_tiny', ['class_token=False']),
    (dict(global_pool='avg'), 'vit_attnres_tiny', ['fc_norm']),  # which AttnRes has no place for
    (dict(pre_norm=True), 'vit_attnres_tiny', ['pre_norm=True']),
])
def test_weights_of_another_vit_raise_naming_what_differs(vit_kwargs, name, names, tmp_path):
    vit = timm.create_model('vit_tiny_patch16_224', **dict(CIFAR, **vit_kwargs))
    save_file(vit.state_dict(), tmp_path / 'vit.safetensors')
    with pytest.raises(PretrainedWeightsError) as error:
        timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(tmp_path / 'vit.safetensors')))
    assert all(part in str(error.value) for part in names + ['vit.safetensors']), str(error.value)
