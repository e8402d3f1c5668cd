"""Classify real CIFAR-10 test images with trained weights, loaded as timm loads any pretrained model.

The weights come from a Hub repo (``hf-hub:ORG/NAME``) or from a Hub-ready folder (what ``timm-hbf push --dry-run``
writes, and what ``weights/`` holds until the weights are published): ``timm.create_model(NAME, pretrained=True)``
reads the architecture, its arguments, the preprocessing and the class names from ``config.json`` and the weights
from ``model.safetensors`` (bf16 weights load into the float32 model). The images go through the model's own eval
transform (``resolve_data_config`` + ``create_transform``).

    python examples/classify_cifar10.py weights/vit_hyperbf_tiny.c10
    python examples/classify_cifar10.py hf-hub:ORG/vit_hyperbf_tiny.c10 --images 20

``--data`` is a CIFAR-10 archive (default ``../shared/datasets/cifar10-jpeg.tar.gz``) or its extracted folder; the
images are the first test images of each class in turn.
"""
import argparse
import io
import tarfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import timm
import torch
from PIL import Image
from timm.data import create_transform, resolve_data_config

import timm_hbf  # noqa: F401  (registers the models)

DEFAULT_DATA = Path(__file__).resolve().parents[2] / 'shared' / 'datasets' / 'cifar10-jpeg.tar.gz'


def load_model(source: str) -> torch.nn.Module:
    """A model with its trained weights: ``source`` is a folder (``local-dir:``) or a timm model name such as
    ``hf-hub:ORG/NAME``."""
    name = f'local-dir:{source}' if Path(source).is_dir() else source
    return timm.create_model(name, pretrained=True).eval()


def cifar10_test_images(data: Path, count: int) -> List[Tuple[str, str, Image.Image]]:
    """``count`` test images as (path, class, image): the first of each class, then the second of each, ..."""
    if data.is_dir():
        names = select(sorted(str(p.relative_to(data)) for p in data.glob('test/*/*')), count)
        contents = {name: (data / name).read_bytes() for name in names}
    else:
        with tarfile.open(data) as tar:
            members = {m.name.removeprefix('./'): m for m in tar.getmembers() if m.isfile()}
            names = select(sorted(name for name in members if name.startswith('test/')), count)
            contents = {name: tar.extractfile(members[name]).read() for name in names}
    return [(name, name.split('/')[1], Image.open(io.BytesIO(contents[name])).convert('RGB')) for name in names]


def select(names: Sequence[str], count: int) -> List[str]:
    """``count`` of ``test/CLASS/FILE`` names, taking each class's files in order, class after class."""
    by_class: Dict[str, List[str]] = {}
    for name in names:
        by_class.setdefault(name.split('/')[1], []).append(name)
    return [name for round_ in zip(*by_class.values()) for name in round_][:count]


@torch.no_grad()
def classify(model: torch.nn.Module, images: List[Image.Image]) -> torch.Tensor:
    """Class probabilities of ``images``, through the model's eval transform."""
    transform = create_transform(**resolve_data_config(model=model))
    return model(torch.stack([transform(image) for image in images])).softmax(-1)


def main(argv: Optional[Sequence[str]] = None) -> List[Dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('model', help='a Hub-ready folder, or hf-hub:ORG/NAME')
    parser.add_argument('--data', default=str(DEFAULT_DATA), help='CIFAR-10 archive or folder (default: %(default)s)')
    parser.add_argument('--images', type=int, default=10, help='how many test images (default: %(default)s)')
    args = parser.parse_args(argv)

    model = load_model(args.model)
    labels = model.pretrained_cfg.get('label_names') or [str(i) for i in range(model.num_classes)]
    images = cifar10_test_images(Path(args.data), args.images)
    probabilities = classify(model, [image for _, _, image in images])
    results = []
    print(f"{model.pretrained_cfg['architecture']} from {args.model}\n")
    print('| image | class | predicted | probability |\n|---|---|---|---|')
    for (path, truth, _), p in zip(images, probabilities):
        predicted = labels[p.argmax().item()]
        results.append(dict(image=path, label=truth, predicted=predicted, probability=p.max().item()))
        print(f"| {path} | {truth} | {predicted}{'' if predicted == truth else ' (wrong)'} | {p.max().item():.2f} |")
    correct = sum(r['label'] == r['predicted'] for r in results)
    print(f'\n{correct} of {len(results)} correct')
    return results


if __name__ == '__main__':
    main()
