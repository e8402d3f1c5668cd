"""Classify real CIFAR-10 test images with the pretrained models, offline: accuracy per model and per class, and a
picture of what they see (a grid of test images with each model's prediction, and each model's confusion matrix).

    python examples/classify_cifar10.py                          # every shipped model, the repository's sample
    python examples/classify_cifar10.py --data cifar10/          # the full 10,000-image test set (folder or archive)
    python examples/classify_cifar10.py --models vit_hyperbf_tiny hf-hub:ORG/NAME local-dir:PATH

``--data`` is a CIFAR-10 folder or ``.tar.gz`` archive holding ``test/<class>/*.jpg`` (ImageFolder layout); the
default is the sample that comes with the repository (20 test images of every class). ``--models`` takes any name
``timm.create_model(NAME, pretrained=True)`` takes; the default is every model of timm-hbf with shipped weights.
Writes ``results.json`` and ``predictions.png`` into ``--out``.
"""
import argparse
import json
import tarfile
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import timm
import torch
from timm.data import ImageDataset, create_transform, resolve_data_config

import timm_hbf  # noqa: F401  (registers the models)

SAMPLE = Path(__file__).resolve().parents[1] / 'data' / 'cifar10-mini-jpeg.tar.gz'
GRID_PER_CLASS = 3  # images of every class in the picture


def shipped_models() -> List[str]:
    """Every timm-hbf model that has weights."""
    return timm.list_models(module=['vit_hyperbf', 'vit_qimia'], pretrained=True)


def test_folder(data: Path, stack: ExitStack) -> Path:
    """The ``test/`` folder in ``data`` or in a folder of it; an archive is extracted into a temporary folder first."""
    given = data
    if data.is_file() and tarfile.is_tarfile(data):
        root = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        with tarfile.open(data) as tar:
            tar.extractall(root, **({'filter': 'data'} if hasattr(tarfile, 'data_filter') else {}))
        data = root
    for root in [data, *sorted(data.iterdir())] if data.is_dir() else []:
        if (root / 'test').is_dir():
            return root / 'test'
    raise SystemExit(f'--data {given}: expected a CIFAR-10 folder or .tar.gz archive with test/<class>/*.jpg in it or '
                     'in a folder of it (the ImageFolder layout timm reads).')


@torch.inference_mode()
def predict(model: torch.nn.Module, folder: Path, batch_size: int = 250) -> Dict[str, torch.Tensor]:
    """Labels and predictions of every image of ``folder``, through the model's own eval transform."""
    dataset = ImageDataset(str(folder), transform=create_transform(**resolve_data_config(model=model)))
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size)
    labels, predictions = [], []
    for images, targets in loader:
        labels.append(targets)
        predictions.append(model(images).argmax(-1))
    return dict(labels=torch.cat(labels), predictions=torch.cat(predictions), files=dataset.filenames())


def check_classes(name: str, model: torch.nn.Module, classes: Sequence[str]) -> None:
    """The model must classify the data's classes, in their order (where its pretrained cfg names its classes)."""
    names = model.pretrained_cfg.get('label_names')
    if model.num_classes != len(classes) or (names is not None and list(names) != list(classes)):
        described = f'the classes {list(names)}' if names is not None else f'{model.num_classes} classes'
        raise SystemExit(f'{name} predicts {described}, not the data\'s {list(classes)}: name a CIFAR-10 classifier '
                         'with --models.')


def confusion(labels: torch.Tensor, predictions: torch.Tensor, num_classes: int) -> torch.Tensor:
    """``(true, predicted)`` counts."""
    return torch.bincount(labels * num_classes + predictions, minlength=num_classes ** 2).view(num_classes, -1)


def draw(results: List[Dict], folder: Path, classes: Sequence[str], path: Path) -> None:
    """The picture: test images (``GRID_PER_CLASS`` of every class) with each model's prediction, then each model's
    confusion matrix."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    from PIL import Image

    first = results[0]
    picked = [i for c in range(len(classes)) for i in (first['labels'] == c).nonzero().flatten()[:GRID_PER_CLASS]]
    columns = len(classes)
    rows = -(-len(picked) // columns)
    fig = plt.figure(figsize=(1.3 * columns, 1.5 * rows + 3.2), layout='constrained')
    grid, matrices = fig.subfigures(2, 1, height_ratios=[1.5 * rows, 3.2])
    for k, ax in enumerate(grid.subplots(rows, columns, squeeze=False).flat):
        ax.axis('off')
        if k >= len(picked):
            continue
        i = int(picked[k])
        ax.imshow(Image.open(folder / first['files'][i]).convert('RGB'))
        truth = int(first['labels'][i])
        lines = [(classes[int(r['predictions'][i])], int(r['predictions'][i]) == truth) for r in results]
        ax.set_title(classes[truth], fontsize=8, fontweight='bold')
        for j, (text, right) in enumerate(lines):
            ax.text(0.5, -0.08 - 0.16 * j, text, transform=ax.transAxes, ha='center', va='top', fontsize=7,
                    color='tab:green' if right else 'tab:red')
    grid.suptitle('test images: true class (bold), then the prediction of ' +
                  ', '.join(r['model'] for r in results) + ' (green right, red wrong)', fontsize=9)
    for ax, r in zip(matrices.subplots(1, len(results), squeeze=False)[0], results):
        matrix = confusion(r['labels'], r['predictions'], len(classes))
        ax.imshow(matrix.numpy(), cmap='Blues')
        ax.set_xticks(range(len(classes)), classes, rotation=90, fontsize=7)
        ax.set_yticks(range(len(classes)), classes, fontsize=7)
        ax.set_xlabel('predicted', fontsize=8)
        ax.set_title(f"{r['model']}: {r['top1']:.1f} % top-1", fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> List[Dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--models', nargs='+', help='models to load with pretrained=True (default: every shipped one)')
    parser.add_argument('--data', type=Path, default=SAMPLE, help='CIFAR-10 folder or archive (default: the sample)')
    parser.add_argument('--out', type=Path, default=Path('output/classify_cifar10'), help='default: %(default)s')
    args = parser.parse_args(argv)
    names = args.models or shipped_models()
    if not names:
        raise SystemExit('No model given and none of timm-hbf ships weights: name one with --models.')

    results = []
    with ExitStack() as stack:
        folder = test_folder(args.data, stack)
        classes = ImageDataset(str(folder)).reader.class_to_idx
        classes = sorted(classes, key=classes.get)
        for name in names:
            start = time.perf_counter()
            model = timm.create_model(name, pretrained=True).eval()
            check_classes(name, model, classes)
            out = predict(model, folder)
            correct = out['predictions'] == out['labels']
            per_class = [100. * correct[out['labels'] == c].float().mean().item() for c in range(len(classes))]
            results.append(dict(model=name, top1=100. * correct.float().mean().item(), correct=int(correct.sum()),
                                images=len(correct), per_class=dict(zip(classes, per_class)),
                                seconds=time.perf_counter() - start, **out))
        print(f'{len(results[0]["labels"])} CIFAR-10 test images from {args.data}\n')
        print('| class | ' + ' | '.join(r['model'] for r in results) + ' |')
        print('|---' * (len(results) + 1) + '|')
        for c in classes:
            print(f'| {c} | ' + ' | '.join(f"{r['per_class'][c]:.1f}" for r in results) + ' |')
        print('| **top-1** | ' + ' | '.join(f"**{r['top1']:.2f}** ({r['correct']}/{r['images']})" for r in results)
              + ' |')
        args.out.mkdir(parents=True, exist_ok=True)
        draw(results, folder, classes, args.out / 'predictions.png')
    summary = [{k: v for k, v in r.items() if k not in ('labels', 'predictions', 'files')} for r in results]
    (args.out / 'results.json').write_text(json.dumps(dict(data=str(args.data), models=summary), indent=2) + '\n')
    print(f"\nwrote {args.out / 'results.json'} and {args.out / 'predictions.png'}")
    return summary


if __name__ == '__main__':
    main()
