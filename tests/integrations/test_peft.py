"""LoRA through PEFT on both families: adapters on the blocks' Linear layers train on real CIFAR-10 images, the
model's own weights unchanged, and merge into a plain timm model with the adapted outputs. HyperBF's centres take LoRA
(``target_parameters``); its widths and metric train in ``modules_to_save``."""
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import timm
import torch
from torch import nn

from .conftest import DEPTH, MODELS, cifar10_batch, train_step

peft = pytest.importorskip('peft', reason='peft is a test extra: pip install -e ".[test]"')

RANK = 4


def trained_model(name: str, data: Path, **kwargs) -> nn.Module:
    """``name`` with 2 blocks after a full training step on the CIFAR-10 images of ``data``: a stand-in for a
    pretrained model, with no parameter at its init (QIMIA's keys get gradients only once its queries left zero)."""
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=10, depth=DEPTH, **kwargs)
    train_step(model, model.parameters(), *cifar10_batch(data, model))
    return model


def block_linears(model: nn.Module) -> List[str]:
    """The names of the Linear layers of the blocks (attention, feed-forward and, in QIMIA, key and value paths)."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and name.startswith('blocks.')]


def snapshot(model: nn.Module) -> Dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def changed(before: Dict[str, torch.Tensor], after: Dict[str, torch.Tensor]) -> List[str]:
    return [k for k, v in before.items() if not torch.equal(v, after[k])]


def adapt_train_merge(
        model: nn.Module, config: 'peft.LoraConfig', images: torch.Tensor, targets: torch.Tensor,
) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor], torch.Tensor, nn.Module]:
    """LoRA ``config`` on ``model``, one training step of what PEFT leaves trainable, then merged back. Returns the
    adapted model's state before and after the step, its eval outputs on ``images``, and the merged model."""
    adapted = peft.get_peft_model(model, config)
    before = snapshot(adapted)
    train_step(adapted, [p for p in adapted.parameters() if p.requires_grad], images, targets)
    after = snapshot(adapted)
    with torch.no_grad():
        outputs = adapted.eval()(images)
    return before, after, outputs, adapted.merge_and_unload()


def assert_plain_timm_model(merged: nn.Module, name: str, **kwargs) -> None:
    """``merged`` is ``name`` as timm builds it, no adapter left, and loads into it."""
    plain = timm.create_model(name, num_classes=10, depth=DEPTH, **kwargs)
    assert type(merged) is type(plain)
    assert merged.state_dict().keys() == plain.state_dict().keys()
    plain.load_state_dict(merged.state_dict())


@pytest.mark.parametrize('name', MODELS)
def test_lora_on_the_block_linears_trains_only_the_adapters_and_merges(name, cifar10_tiny):
    model = trained_model(name, cifar10_tiny / 'train')
    images, targets = cifar10_batch(cifar10_tiny / 'train', model)
    with torch.no_grad():
        base_outputs = model.eval()(images)
    adapted_layers = block_linears(model)
    config = peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=adapted_layers)
    before, after, outputs, merged = adapt_train_merge(model, config, images, targets)

    base_weights = [k for k in before if 'lora_' not in k]
    assert changed(before, after) and not changed({k: before[k] for k in base_weights}, after)
    # every adapter took part in the forward pass: its B factor (zero at init) moved
    unused = [t for t in adapted_layers if not [k for k in changed(before, after) if f'{t}.lora_B.' in k]]
    assert not unused, f'adapters the forward pass never used: {unused}'
    assert not torch.allclose(outputs, base_outputs, atol=1e-4)  # the adapters change the outputs

    assert_plain_timm_model(merged, name)
    with torch.no_grad():
        torch.testing.assert_close(merged.eval()(images), outputs, rtol=0., atol=1e-5)


def test_hyperbf_widths_and_metric_train_in_modules_to_save(cifar10_tiny):
    model = trained_model('vit_hyperbf_tiny', cifar10_tiny / 'train', mahalanobis=True)
    images, targets = cifar10_batch(cifar10_tiny / 'train', model)
    config = peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=block_linears(model),
                             modules_to_save=['kernel'])
    before, after, outputs, merged = adapt_train_merge(model, config, images, targets)

    moved = changed(before, after)
    kernel_copies = [k for k in moved if '.kernel.modules_to_save.' in k]
    assert {k.rsplit('.', 1)[-1] for k in kernel_copies} == {'log_gamma', 'metric'}
    assert len(kernel_copies) == 2 * 2 * DEPTH  # widths and metric of every attention and MLP
    assert all('lora_' in k or '.modules_to_save.' in k for k in moved)  # the originals stay as they were

    assert_plain_timm_model(merged, 'vit_hyperbf_tiny', mahalanobis=True)
    merged_state = merged.state_dict()
    for key in kernel_copies:  # the merged model carries the trained copies
        original = key.removeprefix('base_model.model.').replace('.modules_to_save.default', '')
        assert torch.equal(merged_state[original], after[key])
    with torch.no_grad():
        torch.testing.assert_close(merged.eval()(images), outputs, rtol=0., atol=1e-5)


def test_hyperbf_centres_take_lora_through_target_parameters(cifar10_tiny):
    model = trained_model('vit_hyperbf_tiny', cifar10_tiny / 'train')
    centres = {name: p.detach().clone() for name, p in model.named_parameters() if name.endswith('mlp.centers')}
    images, targets = cifar10_batch(cifar10_tiny / 'train', model)
    attention = [name for name in block_linears(model) if '.attn.' in name]
    config = peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=attention,
                             target_parameters=['mlp.centers'])
    before, after, outputs, merged = adapt_train_merge(model, config, images, targets)

    assert all('lora_' in k for k in changed(before, after))
    assert_plain_timm_model(merged, 'vit_hyperbf_tiny')
    merged_centres = dict(merged.named_parameters())
    for name, original in centres.items():  # a low-rank shift of the centres
        shift = merged_centres[name].detach() - original
        assert 0 < torch.linalg.matrix_rank(shift) <= RANK
    with torch.no_grad():
        torch.testing.assert_close(merged.eval()(images), outputs, rtol=0., atol=1e-5)
