"""What the client tests share: real CIFAR-10 images (the training tests' cut of the mini archive) and a training
step."""
from pathlib import Path
from typing import Iterable, Tuple

import torch
from timm.data import ImageDataset, create_transform, resolve_model_data_config
from torch import nn

from ..training.conftest import cifar10_tiny  # noqa: F401  (a fixture: train/ 40 images, test/ 20)

MODELS = ['vit_hyperbf_tiny', 'vit_qimia_tiny']  # one model of each family; built with 2 blocks in these tests
DEPTH = 2


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
