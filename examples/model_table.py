"""Size, compute, speed and top-1 of every model this package registers, on real CIFAR-10 images.

Each model is built with ``timm.create_model(name, num_classes=10)`` and classifies a CIFAR-10 split through its own
eval transform (``resolve_data_config`` + ``create_transform``): the 32 x 32 models take the images as they are,
normalised with the CIFAR-10 mean and std; the 224 x 224 models upsample them with the resize and centre crop of
their own config (bicubic to 248, crop 224).

    python examples/model_table.py                                  # the repository's sample (200 test images)
    python examples/model_table.py --data cifar10 --limit 1000 --limit-224 200   # the full test split
    python examples/model_table.py --markdown-only                 # the README model table (no data, no timing)

Columns:

* params (M): parameters with a 10-class head.
* GMACs: multiply-accumulates of a one-image forward at the model's input size, counted with
  ``torch.utils.flop_counter.FlopCounterMode`` (FLOPs / 2). The count covers matrix products, the patch convolution
  and attention's two products (``scaled_dot_product_attention`` runs its math backend while counting: not every
  torch version counts the fused CPU kernel), at the widths an inference forward uses (HyperBF's q and k one key-norm
  channel wider, padded to a multiple of 8). Element-wise ops (the HyperBF exponentials, norms, softmax, QIMIA's
  reads over depth) are not counted, as in timm's and fvcore's counts.
* img/s: images per second of the model's forward alone (no decoding or transforms), over all images of the split
  (or ``--limit``), after one untimed warm-up batch. On a shared CPU it moves with the machine's load; on a busy
  one, ``--threads 1`` can be several times faster than torch's default of one thread per core.
* top-1 (%): accuracy on those images. The models are built without their pretrained weights, so top-1 sits at
  chance (about 10 %) by construction: the column checks the data path end to end, not the models (the accuracy of
  the pretrained ones: ``classify_cifar10.py``).
  A randomly initialised ViT often predicts the same class for every image, which scores exactly 10 % on a
  class-balanced split.

To keep a default run within a few minutes on a small CPU, models at 224 x 224 or more classify only
``--limit-224`` images (default 25, spread evenly over the classes); the header says how many each group used.
"""
import argparse
import pkgutil
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import timm
import torch
from script_checks import check_counts, check_data, check_models, extract_archive
from timm.data import create_dataset, create_transform, resolve_data_config
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.flop_counter import FlopCounterMode

import timm_hbf

SAMPLE = Path(__file__).resolve().parents[1] / 'data' / 'cifar10-mini-jpeg.tar.gz'  # the repository's sample
LARGE_INPUT = 224  # models at this input size or more use --limit-224


def model_names() -> List[str]:
    """Every architecture registered by a module of ``timm_hbf.models``."""
    modules = [m.name for m in pkgutil.iter_modules(timm_hbf.models.__path__) if not m.name.startswith('_')]
    return timm.list_models(module=modules)


def count_gmacs(model: torch.nn.Module, input_size: Sequence[int], device: torch.device) -> float:
    """GMACs of a one-image forward (FLOPs / 2 / 1e9)."""
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(torch.randn(1, *input_size, device=device))
    return counter.get_total_flops() / 2 / 1e9


def find_split(root: Path, split: str, given: Optional[Path] = None) -> Path:
    """``root/split`` or ``root/<one folder>/split`` (archives with a top-level folder); ``given`` is the ``--data``
    that ``root`` holds (an archive extracted there), named if the split is missing."""
    for path in [root / split, *sorted(root.glob(f'*/{split}'))]:
        if path.is_dir():
            return path
    raise SystemExit(f"--data {given or root}: no {split}/ folder in it or in a folder of it. Give a CIFAR-10 folder "
                     f"or .tar.gz archive in the ImageFolder layout ({split}/<class>/*.jpg), or --split.")


def extract(archive: Path, split: str, dest: str) -> Path:
    """Extract the members of ``split`` from a .tar.gz into ``dest`` and return the split folder."""
    extract_archive(archive, Path(dest), keep=lambda member: split in Path(member.name).parts[:2])
    return find_split(Path(dest), split, given=archive)


def sync(device: torch.device) -> None:
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def evaluate(
        name: str,
        dataset: Optional[Dataset],
        limit: Optional[int],
        batch_size: int,
        device: torch.device,
) -> Dict:
    """Build one model and measure it; ``dataset`` is None for the size columns only."""
    model = timm.create_model(name, num_classes=10).to(device).eval()
    cfg = resolve_data_config({}, model=model)
    row = dict(
        model=name,
        params=sum(p.numel() for p in model.parameters()) / 1e6,
        gmacs=count_gmacs(model, cfg['input_size'], device),
        input='x'.join(str(s) for s in cfg['input_size'][1:]),
        input_px=max(cfg['input_size'][1:]),
    )
    if dataset is None:
        return row

    dataset.transform = create_transform(**cfg)
    n = len(dataset) if limit is None else min(limit, len(dataset))
    # ImageFolder sorts by class: evenly spaced indices keep a capped subset balanced over the classes
    subset = Subset(dataset, [i * len(dataset) // n for i in range(n)])
    loader = DataLoader(subset, batch_size=batch_size, shuffle=False, num_workers=0)
    correct, seconds = 0, 0.
    with torch.inference_mode():
        for i, (images, targets) in enumerate(loader):
            images, targets = images.to(device), targets.to(device)
            if i == 0:
                model(images)  # warm-up
            sync(device)
            start = time.perf_counter()
            logits = model(images)
            sync(device)
            seconds += time.perf_counter() - start
            correct += (logits.argmax(-1) == targets).sum().item()
    return dict(row, images=n, img_s=n / seconds, top1=100. * correct / n)


def device_name(device: torch.device) -> str:
    if device.type == 'cuda':
        return torch.cuda.get_device_name(device)
    threads = torch.get_num_threads()
    return f"CPU ({platform.machine()}, {threads} thread{'s' if threads > 1 else ''})"


def check_device(parser: argparse.ArgumentParser, device: str) -> torch.device:
    """``--device`` as a torch device, where torch has it here; else ``parser.error``."""
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as e:  # an unknown type, or one this machine or build lacks
        parser.error(f'--device {device}: {str(e).splitlines()[0]}')
    return torch.device(device)


def main(argv: Optional[Sequence[str]] = None) -> List[Dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--data', default=str(SAMPLE),
                        help="CIFAR-10 folder or .tar.gz archive (default: the repository's sample)")
    parser.add_argument('--split', default='test', help='split folder inside the data')
    parser.add_argument('--batch-size', type=int, default=50)
    parser.add_argument('--limit', type=int, help='images per model (default: the whole split)')
    parser.add_argument('--limit-224', type=int, default=25,
                        help=f'images per model at {LARGE_INPUT} px or more (default: 25; 0: as --limit)')
    parser.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    parser.add_argument('--threads', type=int, help='torch CPU threads (default: torch default)')
    parser.add_argument('--models', nargs='+', help='model names (default: every registered model of ours)')
    parser.add_argument('--markdown-only', action='store_true',
                        help='print only the name, params, GMACs and input size table (no data, no timing)')
    args = parser.parse_args(argv)
    names = args.models or model_names()
    check_models(parser, '--models', names)
    check_counts(parser, args, batch_size=1, limit=1, limit_224=0, threads=1)
    device = check_device(parser, args.device)
    data = None if args.markdown_only else check_data(parser, args.data).resolve()
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()

    if args.markdown_only:
        rows = sorted((evaluate(n, None, None, args.batch_size, device) for n in names),
                      key=lambda r: (r['input_px'], r['gmacs']))
        print('| model | params (M) | GMACs | input |')
        print('|---|---|---|---|')
        for r in rows:
            print(f"| `{r['model']}` | {r['params']:.2f} | {r['gmacs']:.2f} | {r['input']} |")
        return rows

    with tempfile.TemporaryDirectory() as tmp:
        root = extract(data, args.split, tmp) if data.is_file() else find_split(data, args.split)
        dataset = create_dataset('', root=str(root))
        rows = []
        for name in names:
            limit = args.limit
            if args.limit_224 and max(timm.get_pretrained_cfg_value(name, 'input_size')[1:]) >= LARGE_INPUT:
                limit = min(limit or args.limit_224, args.limit_224)
            rows.append(evaluate(name, dataset, limit, args.batch_size, device))
            print(f"{name}: {rows[-1]['images']} images, {rows[-1]['img_s']:.1f} img/s", file=sys.stderr, flush=True)
    rows.sort(key=lambda r: (r['input_px'], r['gmacs']))

    per_model = {f"{r['images']} at {r['input']}": None for r in rows}
    print(f'{device_name(device)}, torch {torch.__version__}, timm {timm.__version__}, timm_hbf {timm_hbf.__version__}')
    print(f"data: {data} ({args.split} split, {len(dataset)} images); images per model: {', '.join(per_model)}; "
          f'batch size {args.batch_size}\n')
    print('| model | params (M) | GMACs | input | img/s | top-1 (%) |')
    print('|---|---|---|---|---|---|')
    for r in rows:
        print(f"| `{r['model']}` | {r['params']:.2f} | {r['gmacs']:.2f} | {r['input']} | {r['img_s']:.1f} | "
              f"{r['top1']:.1f} |")
    print('\nThe models are built untrained (random init; examples/classify_cifar10.py runs the pretrained ones), so '
          'top-1 is chance level (about 10%) by construction.')
    print(f'Total wall time: {time.perf_counter() - start:.1f} s')
    return rows


if __name__ == '__main__':
    main()
