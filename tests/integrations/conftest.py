"""What the client tests share: real CIFAR-10 images (a small cut of the committed sample) and a training step."""
import shutil
from pathlib import Path
from typing import Iterable, Tuple

import pytest
import torch
from timm.data import ImageDataset, create_transform, resolve_model_data_config
from torch import nn

MODELS = ['vit_hyperbf_tiny', 'vit_qimia_tiny']  # one model of each family; built with 2 blocks in these tests
DEPTH = 2
PER_CLASS = {'train': 4, 'test': 2}  # the first images of every class in each split: each folder is one batch


@pytest.fixture(scope='session')
def cifar10_tiny(cifar10_sample: Path, tmp_path_factory) -> Path:
    """``train/`` (40 images) and ``test/`` (20 images) of real CIFAR-10, one folder per class."""
    root = tmp_path_factory.mktemp('cifar10_tiny')
    for split, count in PER_CLASS.items():
        for class_dir in sorted(p for p in (cifar10_sample / split).iterdir() if p.is_dir()):
            (root / split / class_dir.name).mkdir(parents=True)
            for image in sorted(class_dir.iterdir())[:count]:
                shutil.copy(image, root / split / class_dir.name / image.name)
    return root


def cifar10_batch(folder: Path, model: nn.Module) -> Tuple[torch.Tensor, torch.Tensor]:
    """Every image of the ImageFolder ``folder``, preprocessed for evaluation as ``model``'s config says, and its
    class."""
    dataset = ImageDataset(str(folder), transform=create_transform(**resolve_model_data_config(model)))
    images, targets = zip(*(dataset[i] for i in range(len(dataset))))
    return torch.stack(images), torch.tensor(targets)


def train_step(model: nn.Module, params: Iterable[nn.Parameter], images: torch.Tensor, targets: torch.Tensor,
               lr: float = 1e-2) -> None:
    """One AdamW step of ``params`` on the cross-entropy of ``model`` (left in train mode)."""
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.)
    model.train()
    nn.functional.cross_entropy(model(images), targets).backward()
    optimizer.step()
    optimizer.zero_grad()
