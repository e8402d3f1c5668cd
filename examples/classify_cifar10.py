"""Classify real CIFAR-10 test images with the pretrained models, offline: accuracy per model and per class, and a
picture of what they see (a grid of test images with each model's prediction, and each model's confusion matrix).

    python examples/classify_cifar10.py                          # every model with weights, the repository's sample
    python examples/classify_cifar10.py --data cifar10/          # the full 10,000-image test set (folder or archive)
    python examples/classify_cifar10.py --models vit_qimia_tiny.cifar10_30ep hf-hub:ORG/NAME local-dir:PATH

``--data`` is a CIFAR-10 folder or ``.tar.gz`` archive holding ``test/<class>/*.jpg`` (ImageFolder layout); the
default is the sample that comes with the repository (20 test images of every class). ``--models`` takes any name
``timm.create_model(NAME, pretrained=True)`` takes; the default is every model of timm-hbf with shipped weights, by
the full name of its default tag. Writes ``results.json`` and ``predictions.png`` into ``--out``.
"""
import argparse
import json
import re
import tempfile
import textwrap
import time
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence

import timm
import torch
from script_checks import OUR_MODULES, check_data, check_models, check_output, extract_archive
from timm.data import ImageDataset, create_transform, resolve_data_config
from timm.models import get_pretrained_cfg

from timm_hbf.models import PretrainedWeightsError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

SAMPLE = Path(__file__).resolve().parents[1] / 'data' / 'cifar10-mini-jpeg.tar.gz'
GRID_PER_CLASS = 3  # images of every class in the picture


def shipped_models() -> List[str]:
    """Every timm-hbf model with weights in the package, by the full name (``architecture.tag``) of its default
    weights."""
    archs = timm.list_models(module=OUR_MODULES, pretrained=True, include_tags=False)
    return [f'{arch}.{get_pretrained_cfg(arch).tag}' for arch in archs if get_pretrained_cfg(arch).file]


def test_folder(data: Path, stack: ExitStack) -> Path:
    """The ``test/`` folder in ``data`` or in a folder of it; an archive is extracted into a temporary folder first."""
    given = data
    if data.is_file():
        root = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        extract_archive(data, root)
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


def wrapped(name: str, width: int) -> str:
    """``name`` in lines of up to ``width`` characters where it can be: broken after a '.' or '/', and after a '_'
    within a part still longer."""
    lines = ['']
    for part in re.split(r'(?<=[./])', name):
        for piece in re.split(r'(?<=_)', part) if len(part) > width else [part]:
            if lines[-1] and len(lines[-1]) + len(piece) > width:
                lines.append('')
            lines[-1] += piece
    return '\n'.join(lines)


def picture(results: List[Dict], folder: Path, classes: Sequence[str]) -> 'Figure':
    """The picture: test images (``GRID_PER_CLASS`` of every class), each with every model's prediction below it, one
    line per model, then each model's confusion matrix. Laid out in inches, so that any number of models fits."""
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from PIL import Image

    first, n = results[0], len(results)
    picked = [i for c in range(len(classes)) for i in (first['labels'] == c).nonzero().flatten()[:GRID_PER_CLASS]]
    columns = len(classes)
    rows = -(-len(picked) // columns)
    margin, cell_width, image, line = 0.25, 1.3, 1.0, 0.13        # inches; a line of 7-point text
    cell_height = 0.2 + image + 0.06 + line * n + 0.12            # class, image, predictions, gap
    per_row = min(n, 5)                                           # confusion matrices in rows of up to five
    matrix_rows = -(-n // per_row)
    matrix_width = columns * cell_width / per_row
    size = min(matrix_width - 1.0, 1.55)                          # a matrix; class names left of it and below
    titles = [wrapped(f"{k + 1}. {r['model']}", int(matrix_width / 0.065)) + f"\n{r['top1']:.1f} % top-1"
              for k, r in enumerate(results)]
    title_height = 0.14 * max(title.count('\n') + 1 for title in titles)
    matrix_height = 0.05 + title_height + 0.1 + size + 1.05
    legend = ['Test images with their true class (bold), and below each the prediction of every model, top to bottom '
              '(green right, red wrong):',
              *textwrap.wrap('    '.join(f"{k + 1}.\u00a0{r['model']}" for k, r in enumerate(results)), width=150)]
    header = 0.15 + 0.17 * len(legend) + 0.1
    width, height = columns * cell_width + 2 * margin, header + rows * cell_height + matrix_rows * matrix_height
    fig = Figure(figsize=(width, height))

    def axes(left: float, top: float, w: float, h: float) -> Axes:
        """Axes at a position and size in inches from the top left corner inside the margin."""
        return fig.add_axes(((margin + left) / width, 1 - (top + h) / height, w / width, h / height))

    def text(center: float, top: float, words: str, **kwargs) -> None:
        """Text centred at ``center`` and hanging from ``top``, in inches as for :func:`axes`."""
        fig.text((margin + center) / width, 1 - top / height, words, ha='center', va='top', **kwargs)

    text(columns * cell_width / 2, 0.1, '\n'.join(legend), fontsize=8.5)
    for k, i in enumerate(int(i) for i in picked):
        left, top = (k % columns) * cell_width + (cell_width - image) / 2, header + (k // columns) * cell_height
        truth = int(first['labels'][i])
        ax = axes(left, top + 0.2, image, image)
        ax.imshow(Image.open(folder / first['files'][i]).convert('RGB'))
        ax.axis('off')
        ax.set_title(classes[truth], fontsize=8, fontweight='bold', pad=2)
        for j, r in enumerate(results):
            predicted = int(r['predictions'][i])
            text(left + image / 2, top + 0.2 + image + 0.06 + line * j, f'{j + 1}. {classes[predicted]}', fontsize=7,
                 color='tab:green' if predicted == truth else 'tab:red')
    for k, r in enumerate(results):
        left, top = (k % per_row) * matrix_width, header + rows * cell_height + (k // per_row) * matrix_height
        text(left + matrix_width / 2, top + 0.05, titles[k], fontsize=8)
        ax = axes(left + (matrix_width - size) / 2 + 0.3, top + 0.05 + title_height + 0.1, size, size)
        ax.imshow(confusion(r['labels'], r['predictions'], len(classes)).numpy(), cmap='Blues')
        ax.set_xticks(range(len(classes)), classes, rotation=90, fontsize=7)
        ax.set_yticks(range(len(classes)), classes, fontsize=7)
        ax.set_xlabel('predicted', fontsize=8)
    return fig


def main(argv: Optional[Sequence[str]] = None) -> List[Dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--models', nargs='+',
                        help='models to load with pretrained=True (default: every shipped one, at its default tag)')
    parser.add_argument('--data', type=Path, default=SAMPLE, help='CIFAR-10 folder or archive (default: the sample)')
    parser.add_argument('--out', type=Path, default=Path('output/classify_cifar10'), help='default: %(default)s')
    args = parser.parse_args(argv)
    names = args.models or shipped_models()
    if not names:
        raise SystemExit('No model given and none of timm-hbf ships weights: name one with --models.')
    check_models(parser, '--models', names, weights=True)
    check_data(parser, str(args.data))
    check_output(parser, '--out', args.out, folder=True)  # created once every model has been evaluated

    results = []
    with ExitStack() as stack:
        folder = test_folder(args.data, stack)
        classes = ImageDataset(str(folder)).reader.class_to_idx
        classes = sorted(classes, key=classes.get)
        for name in names:
            start = time.perf_counter()
            try:
                model = timm.create_model(name, pretrained=True).eval()
            except PretrainedWeightsError as e:
                raise SystemExit(f'--models {name}: {e}') from e
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
        picture(results, folder, classes).savefig(args.out / 'predictions.png', dpi=110)
    summary = [{k: v for k, v in r.items() if k not in ('labels', 'predictions', 'files')} for r in results]
    (args.out / 'results.json').write_text(json.dumps(dict(data=str(args.data), models=summary), indent=2) + '\n')
    print(f"\nwrote {args.out / 'results.json'} and {args.out / 'predictions.png'}")
    return summary


if __name__ == '__main__':
    main()
