"""What half precision does to a trained model's test predictions: in its stored weights, and under autocast.

The checkpoint's float32 weights are rounded to ``--dtype`` two ways: as ``timm-hbf push --dtype`` writes them (the
kernel widths ``log_gamma`` kept float32) and with every tensor rounded. Each set is loaded back into a float32 model,
as timm loads a bf16 file, and all three run in float32 on the same test images (the preprocessing of train.py's
evaluation, from the run's ``args.yaml``), so the only difference is the rounding of the stored weights. A fourth
runs the float32 weights under ``--dtype`` autocast. ``--pretrained MODEL.TAG`` measures a model's pretrained weights
(as they are stored, and under autocast) instead of a checkpoint. Reports the top-1 of each, the images whose top-1
class differs from the float32 model's, and the largest logit difference.

    python benchmarks/storage_dtype.py runs/vit_hyperbf_tiny/last.pth.tar --data cifar10 \\
        --out benchmarks/results/storage_dtype_vit_hyperbf_tiny.json
    python benchmarks/storage_dtype.py --pretrained vit_hyperbf_tiny.cifar10_100ep --data cifar10

``--data`` is an ImageFolder dataset with a ``--split`` folder (default ``test``), one folder per class.
"""
import argparse
import json
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import timm
import torch
from timm.data import ImageDataset, create_transform, resolve_data_config

import timm_hbf
from timm_hbf.hub import FLOAT32_PARAM_NAMES, HubError, read_train_output, to_storage_dtype

DTYPES = {'bfloat16': torch.bfloat16, 'float16': torch.float16}


class Autocast(torch.nn.Module):
    """``model`` run under autocast to ``dtype``, its logits returned in float32."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.model, self.dtype = model, dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=self.dtype):
            return self.model(x).float()


def stored_as(model: torch.nn.Module, dtype: torch.dtype, keep_float32: Sequence[str]) -> torch.nn.Module:
    """``model`` with its weights rounded to ``dtype`` (but for ``keep_float32``) and read back into float32."""
    return to_storage_dtype(model, dtype, keep_float32).float()


@torch.no_grad()
def compare(variants: Dict[str, torch.nn.Module], loader: torch.utils.data.DataLoader) -> Dict[str, Dict]:
    """Top-1 of every variant and, against the first, the images whose top-1 class differs and the largest logit
    difference."""
    logits: Dict[str, List[torch.Tensor]] = {name: [] for name in variants}
    targets = []
    for images, target in loader:
        targets.append(target)
        for name, model in variants.items():
            logits[name].append(model(images))
    target = torch.cat(targets)
    reference = torch.cat(next(iter(logits.values())))
    results = {}
    for name, chunks in logits.items():
        out = torch.cat(chunks)
        changed = (out.argmax(1) != reference.argmax(1)).sum().item()
        results[name] = dict(
            top1=round(100. * (out.argmax(1) == target).float().mean().item(), 2),
            changed_predictions=changed,
            changed_percent=round(100. * changed / len(target), 2),
            max_logit_difference=float(f'{(out - reference).abs().max().item():.3g}'),
        )
    return results


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('checkpoint', type=Path, nargs='?',
                        help='train.py checkpoint, or output folder: its last.pth.tar (a best checkpoint may have '
                             'been chosen on the test split)')
    parser.add_argument('--pretrained', metavar='MODEL.TAG', help='measure these pretrained weights instead')
    parser.add_argument('--model', help='the architecture, where neither the checkpoint nor args.yaml names it')
    parser.add_argument('--data', required=True, help='ImageFolder dataset')
    parser.add_argument('--split', default='test', help='the folder of --data to measure on (default: %(default)s)')
    parser.add_argument('--images', type=int, help='evenly spaced images of the split (default: all)')
    parser.add_argument('--dtype', choices=sorted(DTYPES), default='bfloat16')
    parser.add_argument('--batch-size', type=int, default=250)
    parser.add_argument('--out', type=Path, help='write the record here (JSON)')
    args = parser.parse_args(argv)

    split = Path(args.data).expanduser() / args.split
    if not split.is_dir():
        raise SystemExit(f'{split} is not a folder: --data takes an ImageFolder dataset with a {args.split}/ folder.')
    dtype = DTYPES[args.dtype]
    if args.pretrained:
        model = timm.create_model(args.pretrained, pretrained=True).eval()
        variants = {'float32': model, f'float32, {args.dtype} autocast': Autocast(model, dtype)}
        arch, model_kwargs, source, epoch, data_args = args.pretrained, {}, 'pretrained', None, {}
    elif args.checkpoint is None:
        raise SystemExit('Name a train.py checkpoint (or output folder), or --pretrained MODEL.TAG.')
    else:
        checkpoint = args.checkpoint / 'last.pth.tar' if args.checkpoint.is_dir() else args.checkpoint
        try:
            train = read_train_output(checkpoint, model_name=args.model)
        except HubError as e:
            raise SystemExit(str(e)) from e
        variants = {
            'float32': train.create_model(),
            f'{args.dtype}, widths float32 (push)': stored_as(train.create_model(), dtype, FLOAT32_PARAM_NAMES),
            f'{args.dtype}, every tensor': stored_as(train.create_model(), dtype, ()),
        }
        variants[f'float32, {args.dtype} autocast'] = Autocast(variants['float32'], dtype)
        arch, model_kwargs, source, epoch, data_args = (train.arch, train.model_kwargs, checkpoint.name, train.epoch,
                                                        train.args)
    config = resolve_data_config(data_args, model=variants['float32'])
    dataset = ImageDataset(str(split), transform=create_transform(**config))
    if args.images:
        step = max(1, len(dataset) // args.images)
        dataset = torch.utils.data.Subset(dataset, range(0, step * min(args.images, len(dataset)), step))
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size)
    results = compare(variants, loader)
    record = dict(
        model=arch, model_kwargs=model_kwargs, checkpoint=source, epoch=epoch,
        images=len(dataset), split=args.split, data_config=config, results=results,
        platform=platform.platform(),
        versions=dict(torch=torch.__version__, timm=timm.__version__, timm_hbf=timm_hbf.__version__,
                      python=platform.python_version()),
        command=' '.join(['python benchmarks/storage_dtype.py', *(argv if argv is not None else sys.argv[1:])]),
        date=datetime.now(timezone.utc).strftime('%Y-%m-%dT%H:%M:%SZ'),
    )
    for name, result in results.items():
        print(f'{name:<32} top-1 {result["top1"]:6.2f} %   changed {result["changed_predictions"]:>5} of '
              f'{len(dataset)} ({result["changed_percent"]:.2f} %)   '
              f'max logit difference {result["max_logit_difference"]}')
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2) + '\n')
    return record


if __name__ == '__main__':
    main()
