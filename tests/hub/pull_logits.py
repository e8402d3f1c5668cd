"""Run by the Hub tests in a fresh process: ``timm.create_model(MODEL, pretrained=True)``, then the logits on the
CIFAR-10 images of FOLDER (preprocessed as the model's config says) and the weights, saved to OUT.

    python pull_logits.py MODEL FOLDER OUT
"""
import sys

import timm
import torch
from timm.data import ImageDataset, create_transform, resolve_model_data_config

import timm_hbf  # noqa: F401  (registers the models)


def main(model_name: str, folder: str, out: str) -> None:
    torch.set_num_threads(1)  # the same reduction order as the reference logits
    model = timm.create_model(model_name, pretrained=True).eval()
    images = ImageDataset(folder, transform=create_transform(**resolve_model_data_config(model)))
    with torch.no_grad():
        logits = model(torch.stack([images[i][0] for i in range(len(images))]))
    torch.save({'logits': logits, 'state_dict': model.state_dict(), 'pretrained_cfg': model.pretrained_cfg}, out)


if __name__ == '__main__':
    main(*sys.argv[1:])
