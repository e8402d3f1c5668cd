"""Train a model on real CIFAR-10 on the CPU, evaluate it, and save a checkpoint that timm loads back.

    python examples/train_cifar10.py                                   # vit_hyperbf_tiny on the repository's sample
    python examples/train_cifar10.py --model vit_qimia_tiny
    python examples/train_cifar10.py --model vit_tiny_patch16_224 --model-kwargs img_size=32 patch_size=4
    python examples/train_cifar10.py --data cifar10 --epochs 10 --train-images 50000   # the full set, every image

It is the short version of what timm's train.py does, with timm's own components: ``create_dataset`` and
``create_transform`` for the data, ``create_optimizer_v2`` (AdamW, no weight decay on the parameters the model
lists in ``no_weight_decay()``), ``create_scheduler_v2`` (linear warmup, then cosine, stepped every update),
``ModelEmaV3`` and ``CheckpointSaver``. An epoch is ``--train-images`` random images of the train split, so each epoch
sees new ones. The checkpoint has train.py's layout (``state_dict``, ``state_dict_ema``, ``optimizer``, ``args``);
``timm.create_model(name, num_classes=10, checkpoint_path=...)`` loads its EMA weights, and the accuracy printed at the
end is that of the model loaded back this way, on ``--test-images`` images spread evenly over the test split (so
over the classes).

``--data`` takes CIFAR-10 as a folder with ``train/`` and ``test/`` in the ImageFolder layout, or as a ``.tar.gz``
archive of one, extracted once into ``--cache-dir``. The default is the sample that comes with the repository
(``data/cifar10-mini-jpeg.tar.gz``: 100 train and 20 test images of every class), enough to see the loop run; the
full set trains a model that is better than chance.
"""
import argparse
import itertools
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import timm
import torch
from script_checks import (
    OUR_MODULES,
    check_counts,
    check_data,
    check_model_kwargs,
    check_models,
    check_output,
    extract_archive,
)
from timm.data import create_dataset, create_transform, resolve_data_config
from timm.loss import LabelSmoothingCrossEntropy
from timm.models import split_model_name_tag
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.utils import CheckpointSaver, ModelEmaV3, ParseKwargs, random_seed
from torch.utils.data import DataLoader, Subset
from tqdm import tqdm

import timm_hbf
from timm_hbf.models import PretrainedWeightsError

SAMPLE = Path(__file__).resolve().parents[1] / 'data' / 'cifar10-mini-jpeg.tar.gz'  # the repository's sample
DEFAULT_CACHE = Path(os.environ.get('XDG_CACHE_HOME', Path.home() / '.cache')) / 'timm_hbf'
def image_folder(data: Path, cache: Path) -> Path:
    """The folder holding ``train/`` and ``test/``: ``data`` itself, or the archive ``data`` extracted into ``cache``
    (once: later runs find it there)."""
    if data.is_file():
        target = cache / f"{data.name.split('.')[0]}-{data.stat().st_size}"
        if not target.is_dir():
            cache.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=cache))
            try:
                extract_archive(data, tmp)
                tmp.rename(target)
            except OSError:
                if not target.is_dir():  # else another run extracted it meanwhile
                    raise
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        given, data = data, target
    else:
        given = data
    for root in [data, *sorted(data.iterdir())] if data.is_dir() else []:
        if (root / 'train').is_dir() and (root / 'test').is_dir():
            return root
    raise SystemExit(f"--data {given}: no train/ and test/ folders (ImageFolder layout, one folder per class) in it "
                     'or in a folder of it. Give a CIFAR-10 folder or .tar.gz archive of that layout.')


def evenly_spaced(size: int, count: int) -> List[int]:
    """``count`` indices spread evenly over ``range(size)``: ImageFolder sorts by class, so such a subset is balanced
    over the classes."""
    count = min(count, size)
    return [i * size // count for i in range(count)]


def add_model_arguments(parser: argparse.ArgumentParser, model: str, images: int) -> None:
    """The arguments of a script that looks at a model on test images: the model, its weights and the data."""
    parser.add_argument('--model', default=model)
    parser.add_argument('--model-kwargs', nargs='*', default={}, action=ParseKwargs)
    parser.add_argument('--pretrained', action='store_true', help="the model's pretrained weights")
    parser.add_argument('--checkpoint', default='', help='train.py checkpoint (default: an untrained model)')
    parser.add_argument('--data', default=str(SAMPLE),
                        help="CIFAR-10 folder or .tar.gz archive (default: the repository's sample)")
    parser.add_argument('--cache-dir', default=str(DEFAULT_CACHE),
                        help='where an archive is extracted, once (default: %(default)s)')
    parser.add_argument('--images', type=int, default=images, help='test images to look at (at most all of them)')


def check_model_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``parser.error`` for a bad argument of :func:`add_model_arguments`: checked before anything is computed."""
    check_models(parser, '--model', [args.model], weights=args.pretrained)
    check_model_kwargs(parser, args.model, args.model_kwargs)
    check_counts(parser, args, images=1)
    if args.checkpoint and not Path(args.checkpoint).expanduser().is_file():
        parser.error(f'--checkpoint {args.checkpoint}: no such file (a checkpoint of train.py or train_cifar10.py)')
    check_data(parser, args.data)


def create_model(args: argparse.Namespace) -> torch.nn.Module:
    """The model of :func:`add_model_arguments`'s arguments. A checkpoint of one of our models loads through
    timm-hbf's checked loading (``pretrained_cfg_overlay=dict(file=...)``: its EMA weights, its number of classes),
    any other through timm's ``checkpoint_path``; weights that cannot load exit with one line naming the file and
    what is wrong."""
    ours = split_model_name_tag(args.model)[0] in timm.list_models(module=OUR_MODULES)
    try:
        if args.checkpoint and ours:
            return timm.create_model(args.model, pretrained=True, pretrained_cfg_overlay=dict(file=args.checkpoint),
                                     **args.model_kwargs)
        return timm.create_model(args.model, pretrained=args.pretrained, checkpoint_path=args.checkpoint,
                                 **args.model_kwargs)
    except PretrainedWeightsError as e:
        raise SystemExit(str(e)) from e
    except RuntimeError as e:  # torch's load_state_dict: a header, then a line per weight it could not load
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        if not args.checkpoint or not lines[0].startswith('Error(s) in loading state_dict'):
            raise
        first, more = (lines[1:] or lines)[0], f' (and {len(lines) - 2} more lines)' if len(lines) > 2 else ''
        raise SystemExit(f'--checkpoint {args.checkpoint} does not fit {args.model} as built: {first}{more}. Give the '
                         '--model and --model-kwargs it was trained with.') from e


def model_and_test_images(args: argparse.Namespace) -> Tuple[torch.nn.Module, torch.Tensor]:
    """The model of :func:`add_model_arguments`'s arguments (checked by :func:`check_model_arguments`), and
    ``args.images`` test images spread over the classes through its eval transform (``args.img_size``, ``args.mean``
    and ``args.std`` override its data config, where given, as in timm's validate.py)."""
    model = create_model(args)
    config = resolve_data_config(vars(args), model=model)
    root = image_folder(Path(args.data).expanduser(), Path(args.cache_dir).expanduser())
    dataset = create_dataset('', root=str(root), split='test', transform=create_transform(**config))
    return model, torch.stack([dataset[i][0] for i in evenly_spaced(len(dataset), args.images)])


def holdout_split(size: int, val_images: int) -> Tuple[List[int], List[int]]:
    """Train and validation indices of a train split of ``size`` images: ``val_images`` of them, evenly spaced,
    held out; the rest for training."""
    if val_images >= size:
        raise SystemExit(f'--val-images {val_images} leaves none of the {size} train images for training: lower it.')
    val = evenly_spaced(size, val_images) if val_images > 0 else []
    held_out = set(val)
    return [i for i in range(size) if i not in held_out], val


def evaluate(model: torch.nn.Module, loader: DataLoader, amp: bool) -> float:
    """Top-1 accuracy in percent."""
    model.eval()
    correct = total = 0
    with torch.inference_mode(), torch.autocast('cpu', dtype=torch.bfloat16, enabled=amp):
        for images, targets in tqdm(loader, desc='test', unit='batch', leave=False):
            correct += (model(images).argmax(-1) == targets).sum().item()
            total += len(targets)
    return 100. * correct / total


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--data', default=str(SAMPLE),
                        help="CIFAR-10 folder or .tar.gz archive (default: the repository's sample)")
    parser.add_argument('--cache-dir', default=str(DEFAULT_CACHE),
                        help='where an archive is extracted, once (default: %(default)s)')
    parser.add_argument('--model', default='vit_hyperbf_tiny', help='any timm model name (default: %(default)s)')
    parser.add_argument('--model-kwargs', nargs='*', default={}, action=ParseKwargs,
                        help='extra create_model arguments, as in train.py (e.g. img_size=32 patch_size=4)')
    parser.add_argument('--epochs', type=int, default=1)
    parser.add_argument('--train-images', type=int, default=16384, help='train images per epoch (default: %(default)s)')
    parser.add_argument('--test-images', type=int, default=10000, help='test images to evaluate (default: all)')
    parser.add_argument('--val-images', type=int, default=0,
                        help='train images held out (never trained on) and evaluated as a validation split, for '
                             'choices that must not look at the test set (default: none)')
    parser.add_argument('--batch-size', type=int, default=64)
    parser.add_argument('--lr', type=float, default=2e-3, help='peak learning rate')
    parser.add_argument('--warmup-epochs', type=float, default=0.1, help='linear warmup, in epochs (may be a fraction)')
    parser.add_argument('--weight-decay', type=float, default=0.05)
    parser.add_argument('--smoothing', type=float, default=0.1, help='label smoothing')
    parser.add_argument('--crop-scale', type=float, default=0.75,
                        help='random-resized crops of this fraction of the image area or more (1: no crops)')
    parser.add_argument('--drop-path', type=float, default=0., help='stochastic depth rate')
    parser.add_argument('--ema-decay', type=float, default=0.999, help='ModelEmaV3 decay (with warmup)')
    parser.add_argument('--amp', action='store_true', help='bfloat16 autocast (faster on CPUs with bf16 support)')
    parser.add_argument('--threads', type=int, help='torch CPU threads (default: torch default)')
    parser.add_argument('--workers', type=int, default=1, help='data loading processes')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--output', default='output/train_cifar10', help='checkpoint folder (default: %(default)s)')
    args = parser.parse_args(argv)
    check_models(parser, '--model', [args.model])
    check_model_kwargs(parser, args.model, args.model_kwargs, num_classes=10)
    check_counts(parser, args, epochs=1, train_images=1, test_images=1, val_images=0, batch_size=1, threads=1,
                 workers=0)
    if args.train_images < args.batch_size:  # the loader drops a last, smaller batch
        parser.error(f'--train-images {args.train_images} gives no full batch of --batch-size {args.batch_size}: '
                     'lower --batch-size or raise --train-images')
    data = check_data(parser, args.data)
    output = Path(args.output) / args.model
    check_output(parser, '--output', output, folder=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    random_seed(args.seed)
    start = time.perf_counter()

    model = timm.create_model(args.model, num_classes=10, drop_path_rate=args.drop_path, **args.model_kwargs)
    # CIFAR-10 at its own 32 x 32; mean, std and interpolation from the model's pretrained_cfg
    data_config = resolve_data_config(dict(input_size=(3, 32, 32), crop_pct=1.0), model=model)
    root = image_folder(data, Path(args.cache_dir).expanduser())
    train_set = create_dataset('', root=str(root / 'train'), is_training=True)
    train_set.transform = create_transform(
        **data_config, is_training=True, scale=(args.crop_scale, 1.), hflip=0.5, color_jitter=0.)
    test_set = create_dataset('', root=str(root / 'test'))
    test_set.transform = create_transform(**data_config)
    n_test = min(args.test_images, len(test_set))
    test_subset = Subset(test_set, evenly_spaced(len(test_set), n_test))
    train_indices, val_indices = holdout_split(len(train_set), args.val_images)
    if val_indices:
        val_set = create_dataset('', root=str(root / 'train'))
        val_set.transform = create_transform(**data_config)
        train_set = Subset(train_set, train_indices)

    steps = min(args.train_images, len(train_set)) // args.batch_size
    if not steps:
        left = ' (those --val-images leaves)' if val_indices else ''
        raise SystemExit(f'--batch-size {args.batch_size} is more than the {len(train_set)} train images of --data '
                         f'{args.data}{left}: lower --batch-size.')
    loader_kwargs = dict(num_workers=args.workers, persistent_workers=args.workers > 0)
    train_loader = DataLoader(train_set, args.batch_size, shuffle=True, drop_last=True, **loader_kwargs)
    test_loader = DataLoader(test_subset, 2 * args.batch_size, **loader_kwargs)

    optimizer = create_optimizer_v2(model, 'adamw', lr=args.lr, weight_decay=args.weight_decay)
    scheduler, _ = create_scheduler_v2(
        optimizer, 'cosine', num_epochs=args.epochs, warmup_epochs=args.warmup_epochs, warmup_lr=args.lr / 100,
        step_on_epochs=False, updates_per_epoch=steps,
    )
    ema = ModelEmaV3(model, decay=args.ema_decay, use_warmup=True)
    loss_fn = LabelSmoothingCrossEntropy(args.smoothing)
    output.mkdir(parents=True, exist_ok=True)
    saver = CheckpointSaver(model, optimizer, args=args, model_ema=ema, checkpoint_dir=str(output),
                            recovery_dir=str(output), max_history=1)

    threads = torch.get_num_threads()
    print(f'{args.model}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; '
          f'CPU ({platform.machine()}, {threads} thread{"s" if threads > 1 else ""}), torch {torch.__version__}, '
          f'timm {timm.__version__}, timm_hbf {timm_hbf.__version__}')
    print(f'train: {args.epochs} x {steps * args.batch_size} of {len(train_set)} images ({steps} updates of '
          f'{args.batch_size} per epoch), {"bfloat16 autocast" if args.amp else "float32"}; '
          f'test: {n_test} of {len(test_set)} images'
          + (f'; validation: {len(val_indices)} held-out train images' if val_indices else ''), flush=True)

    train_start = time.perf_counter()
    update = 0
    for epoch in range(args.epochs):
        model.train()
        bar = tqdm(itertools.islice(train_loader, steps), total=steps, desc=f'epoch {epoch + 1}/{args.epochs}',
                   unit='batch')
        for images, targets in bar:
            with torch.autocast('cpu', dtype=torch.bfloat16, enabled=args.amp):
                loss = loss_fn(model(images), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            update += 1
            scheduler.step_update(update)
            ema.update(model, step=update)
            bar.set_postfix(loss=f'{loss.item():.3f}', lr=f'{optimizer.param_groups[0]["lr"]:.2e}')
        saver.save_checkpoint(epoch)
    train_s = time.perf_counter() - train_start

    checkpoint = output / 'last.pth.tar'
    trained = timm.create_model(args.model, num_classes=10, checkpoint_path=str(checkpoint), **args.model_kwargs)
    eval_start = time.perf_counter()
    top1 = evaluate(trained, test_loader, args.amp)
    val_top1 = evaluate(trained, DataLoader(Subset(val_set, val_indices), 2 * args.batch_size, **loader_kwargs),
                        args.amp) if val_indices else None
    eval_s = time.perf_counter() - eval_start
    total_s = time.perf_counter() - start
    print(f'checkpoint: {checkpoint}  (timm.create_model({args.model!r}, num_classes=10, '
          f'checkpoint_path=...) loads its EMA weights)')
    if val_top1 is not None:
        print(f'validation accuracy: {val_top1:.2f} % top-1 on {len(val_indices)} held-out train images')
    print(f'test accuracy: {top1:.2f} % top-1 on {n_test} CIFAR-10 test images (chance: 10 %)')
    print(f'time: {total_s:.0f} s in all ({train_s:.0f} s training, {eval_s:.0f} s evaluation)')
    return dict(top1=top1, val_top1=val_top1, checkpoint=checkpoint, train_s=train_s, eval_s=eval_s, total_s=total_s)


if __name__ == '__main__':
    main()
