"""Fixtures of the Hub tests: the loopback Hub, huggingface_hub in this process pointed at it, and train.py output
folders of short runs."""
import argparse
from collections import OrderedDict
from pathlib import Path
from typing import Optional

import pytest
import timm
import torch
import yaml
from huggingface_hub import constants
from timm.utils import CheckpointSaver, ModelEmaV3, accuracy, update_summary

from .fake_hub import TOKEN, FakeHub

HYPERBF, QIMIA = 'vit_hyperbf_tiny', 'vit_qimia_tiny'  # one model of each family
CIFAR10_LABELS = ['airplane', 'automobile', 'bird', 'cat', 'deer', 'dog', 'frog', 'horse', 'ship', 'truck']


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A loopback Hub, and huggingface_hub in this process using it (``huggingface_hub.constants``) with an empty
    cache, logged in with a token that may write."""
    with FakeHub() as hub:
        for name, value in dict(ENDPOINT=hub.endpoint, HF_HUB_CACHE=str(tmp_path / 'hf-cache'),
                                HUGGINGFACE_CO_URL_TEMPLATE=hub.endpoint + '/{repo_id}/resolve/{revision}/{filename}',
                                HF_TOKEN_PATH=str(tmp_path / 'no-token'), HF_HUB_OFFLINE=False,
                                HF_HUB_DISABLE_XET=True).items():
            monkeypatch.setattr(constants, name, value)
        monkeypatch.setenv('HF_TOKEN', TOKEN)
        monkeypatch.setenv('NO_PROXY', '127.0.0.1')
        yield hub


def train_like_train_py(output: Path, model: str = HYPERBF, epochs: int = 3, gp: Optional[str] = None) -> Path:
    """Train ``model`` (2 blocks, 10 classes) a step per epoch on random images and leave what timm's train.py
    leaves: CheckpointSaver's checkpoints (weights, EMA weights, the argument namespace), ``args.yaml`` and
    ``summary.csv`` (``update_summary``'s, of the EMA weights as train.py evaluates them)."""
    args = argparse.Namespace(
        data_dir='/data/cifar10', dataset='', val_split='validation', model=model, model_kwargs={'depth': 2},
        num_classes=10, gp=gp, img_size=None, mean=None, std=None, crop_pct=0.875, epochs=epochs, batch_size=8,
        opt='adamw', lr=1e-3, weight_decay=0.05, warmup_epochs=0, model_ema=True, model_ema_decay=0.5, seed=0,
        output=str(output.parent))
    output.mkdir(parents=True)
    (output / 'args.yaml').write_text(yaml.safe_dump(vars(args)))
    torch.manual_seed(args.seed)
    net = timm.create_model(model, num_classes=args.num_classes, global_pool=gp, **args.model_kwargs)
    ema = ModelEmaV3(net, decay=args.model_ema_decay)
    optimizer = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    saver = CheckpointSaver(net, optimizer, args=args, model_ema=ema, checkpoint_dir=str(output),
                            recovery_dir=str(output))
    images, targets = torch.randn(args.batch_size, 3, 32, 32), torch.arange(args.batch_size) % args.num_classes
    for epoch in range(epochs):
        loss = torch.nn.functional.cross_entropy(net(images), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ema.update(net, step=epoch)
        with torch.no_grad():
            logits = ema.module.eval()(images)
        top1, top5 = accuracy(logits, targets, topk=(1, 5))
        metrics = OrderedDict(loss=torch.nn.functional.cross_entropy(logits, targets).item(), top1=top1.item(),
                              top5=top5.item())
        update_summary(epoch, OrderedDict(loss=loss.item()), metrics, str(output / 'summary.csv'),
                       lr=args.lr, write_header=epoch == 0)
        saver.save_checkpoint(epoch, metric=-epoch)  # the first epoch is the best: best and last differ
    return output


@pytest.fixture(scope='session')
def train_run(tmp_path_factory) -> Path:
    """A train.py output folder of vit_hyperbf_tiny: its best checkpoint is epoch 0's, its last epoch 2's."""
    return train_like_train_py(tmp_path_factory.mktemp('output') / 'hbf')


def load_checkpoint(path: Path) -> dict:
    """A train.py checkpoint, read as timm reads it (weights only, the argument namespace allowed)."""
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(path, map_location='cpu', weights_only=True)


def assert_same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
