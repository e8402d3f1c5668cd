"""timm's train.py, replayed in-process: its calls into timm, in its order, with the keyword arguments it passes.

train.py is not installed with timm (it is in timm's git repository only), so the tests replay what it does with an
``args`` namespace like its own: train.py's defaults (:data:`TRAIN_PY_DEFAULTS`, from train.py at timm's git commit
aa4b585), then a recipe YAML (``-c``), then the options of a command line. Departures from train.py: no logging,
summaries or wandb; no gradient accumulation; the loaders get ``persistent_workers=False`` without workers (older
timm passes True to torch, which refuses it); :func:`train_one_epoch` returns the loss of every update.
"""
import argparse
from contextlib import nullcontext
from functools import partial
from typing import Callable, Dict, List, Optional

import torch
import yaml
from timm import utils
from timm.data import FastCollateMixup, Mixup, create_dataset, create_loader, resolve_data_config
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.models import create_model, load_checkpoint, resume_checkpoint
from timm.optim import create_optimizer_v2, optimizer_kwargs
from timm.scheduler import create_scheduler_v2, scheduler_kwargs
from timm.utils import CheckpointSaver, ModelEmaV3
from torch import nn

TRAIN_PY_DEFAULTS = dict(
    model='resnet50', pretrained=False, initial_checkpoint='', num_classes=None, gp=None, model_kwargs={},
    drop=0.0, drop_path=None, drop_block=None, bn_momentum=None, bn_eps=None, torchscript=False,
    grad_checkpointing=False, channels_last=False, device='cuda', amp=False, amp_dtype='float16',
    dataset='', data_dir=None, train_split='train', val_split='validation', class_map='', epoch_repeats=0.,
    img_size=None, input_size=None, crop_pct=None, mean=None, std=None, interpolation='', in_chans=None,
    batch_size=128, validation_batch_size=None, workers=4, worker_seeding='all', pin_mem=False, no_prefetcher=False,
    no_aug=False, train_crop_mode=None, scale=[0.08, 1.0], ratio=[3. / 4., 4. / 3.], hflip=0.5, vflip=0.,
    color_jitter=0.4, color_jitter_prob=None, grayscale_prob=None, gaussian_blur_prob=None, aa=None, aug_repeats=0,
    train_interpolation='random', reprob=0., remode='pixel', recount=1, resplit=False,
    mixup=0., cutmix=0., cutmix_minmax=None, mixup_prob=1.0, mixup_switch_prob=0.5, mixup_mode='batch',
    smoothing=0.1, opt='sgd', opt_eps=None, opt_betas=None, momentum=0.9, weight_decay=2e-5,
    layer_decay=None, layer_decay_min_scale=0, layer_decay_no_opt_scale=None, opt_kwargs={},
    sched='cosine', sched_on_updates=False, lr=None, lr_base=0.1, lr_base_size=256, lr_base_scale='',
    warmup_lr=1e-5, min_lr=0, epochs=300, warmup_epochs=5, decay_epochs=90, decay_milestones=[90, 180, 270],
    cooldown_epochs=0, decay_rate=0.1, model_ema=False, model_ema_decay=0.9998, model_ema_warmup=False,
    resume='', seed=42, checkpoint_hist=10, eval_metric='top1',
)


def train_args(recipe: Optional[str] = None, **options) -> argparse.Namespace:
    """train.py's ``args``: its defaults, then the recipe (``-c``), then ``options`` (the command line)."""
    args = dict(TRAIN_PY_DEFAULTS)
    if recipe:
        with open(recipe) as f:
            args.update(yaml.safe_load(f))
    args.update(options)
    args = argparse.Namespace(**args)
    args.prefetcher = not args.no_prefetcher
    args.distributed, args.world_size, args.rank = False, 1, 0
    return args


def create_model_like_train_py(args: argparse.Namespace) -> nn.Module:
    """``create_model`` with train.py's arguments, grad checkpointing, device and memory format."""
    model = create_model(
        args.model,
        pretrained=args.pretrained,
        in_chans=3,
        num_classes=args.num_classes,
        drop_rate=args.drop,
        drop_path_rate=args.drop_path,
        drop_block_rate=args.drop_block,
        global_pool=args.gp,
        bn_momentum=args.bn_momentum,
        bn_eps=args.bn_eps,
        scriptable=args.torchscript,
        checkpoint_path=args.initial_checkpoint,
        **args.model_kwargs,
    )
    if args.num_classes is None:
        args.num_classes = model.num_classes
    if args.grad_checkpointing:
        model.set_grad_checkpointing(enable=True)
    model.to(device=args.device)
    if args.channels_last:
        model.to(memory_format=torch.channels_last)
    return model


def create_loaders(args: argparse.Namespace, model: nn.Module) -> Dict:
    """Data config, datasets, train (with mixup) and eval loaders, train loss, as train.py makes them."""
    data_config = resolve_data_config(vars(args), model=model)
    datasets = {
        split: create_dataset(
            args.dataset,
            root=args.data_dir,
            split=split,
            is_training=split == args.train_split,
            class_map=args.class_map,
            download=False,
            batch_size=args.batch_size,
            seed=args.seed,
            repeats=args.epoch_repeats if split == args.train_split else 0,
            input_img_mode='RGB',
        )
        for split in (args.train_split, args.val_split)
    }
    common = dict(
        mean=data_config['mean'],
        std=data_config['std'],
        pin_memory=args.pin_mem,
        img_dtype=torch.float32,
        device=torch.device(args.device),
        distributed=args.distributed,
        use_prefetcher=args.prefetcher,
        persistent_workers=args.workers > 0,  # as timm 1.0.31 does itself (see the module docstring)
    )
    mixup_fn = collate_fn = None
    mixup_active = args.mixup > 0 or args.cutmix > 0. or args.cutmix_minmax is not None
    if mixup_active:
        mixup_args = dict(
            mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, cutmix_minmax=args.cutmix_minmax, prob=args.mixup_prob,
            switch_prob=args.mixup_switch_prob, mode=args.mixup_mode, label_smoothing=args.smoothing,
            num_classes=args.num_classes,
        )
        if args.prefetcher:
            collate_fn = FastCollateMixup(**mixup_args)
        else:
            mixup_fn = Mixup(**mixup_args)
    loader_train = create_loader(
        datasets[args.train_split],
        input_size=data_config['input_size'],
        batch_size=args.batch_size,
        is_training=True,
        no_aug=args.no_aug,
        re_prob=args.reprob,
        re_mode=args.remode,
        re_count=args.recount,
        re_split=args.resplit,
        train_crop_mode=args.train_crop_mode,
        scale=args.scale,
        ratio=args.ratio,
        hflip=args.hflip,
        vflip=args.vflip,
        color_jitter=args.color_jitter,
        color_jitter_prob=args.color_jitter_prob,
        grayscale_prob=args.grayscale_prob,
        gaussian_blur_prob=args.gaussian_blur_prob,
        auto_augment=args.aa,
        num_aug_repeats=args.aug_repeats,
        num_aug_splits=0,
        interpolation=args.train_interpolation or data_config['interpolation'],
        num_workers=args.workers,
        worker_seeding=args.worker_seeding,
        collate_fn=collate_fn,
        **common,
    )
    loader_eval = create_loader(
        datasets[args.val_split],
        input_size=data_config['input_size'],
        batch_size=args.validation_batch_size or args.batch_size,
        is_training=False,
        interpolation=data_config['interpolation'],
        num_workers=args.workers,
        crop_pct=data_config['crop_pct'],
        **common,
    )
    if mixup_active:
        train_loss_fn = SoftTargetCrossEntropy()
    elif args.smoothing:
        train_loss_fn = LabelSmoothingCrossEntropy(smoothing=args.smoothing)
    else:
        train_loss_fn = nn.CrossEntropyLoss()
    return dict(data_config=data_config, loader_train=loader_train, loader_eval=loader_eval, mixup_fn=mixup_fn,
                train_loss_fn=train_loss_fn)


def create_optimizer(args: argparse.Namespace, model: nn.Module) -> torch.optim.Optimizer:
    """The learning rate from ``lr_base`` and the global batch unless ``lr`` is given, then ``create_optimizer_v2``."""
    if not args.lr:
        batch_ratio = args.batch_size * args.world_size / args.lr_base_size
        if not args.lr_base_scale:
            args.lr_base_scale = 'sqrt' if any(o in args.opt.lower() for o in ('ada', 'lamb')) else 'linear'
        args.lr = args.lr_base * (batch_ratio ** 0.5 if args.lr_base_scale == 'sqrt' else batch_ratio)
    return create_optimizer_v2(model, **optimizer_kwargs(cfg=args), **args.opt_kwargs)


def create_ema(args: argparse.Namespace, model: nn.Module) -> Optional[ModelEmaV3]:
    return ModelEmaV3(model, decay=args.model_ema_decay, use_warmup=args.model_ema_warmup) if args.model_ema else None


def create_scheduler(args: argparse.Namespace, optimizer: torch.optim.Optimizer, updates_per_epoch: int):
    """``create_scheduler_v2`` with train.py's arguments; returns the scheduler and the number of epochs."""
    return create_scheduler_v2(
        optimizer, **scheduler_kwargs(args, decreasing_metric=False), updates_per_epoch=updates_per_epoch)


def create_saver(args: argparse.Namespace, model: nn.Module, optimizer: torch.optim.Optimizer,
                 model_ema: Optional[ModelEmaV3], output_dir: str) -> CheckpointSaver:
    return CheckpointSaver(
        model=model, optimizer=optimizer, args=args, model_ema=model_ema, amp_scaler=None, checkpoint_dir=output_dir,
        recovery_dir=output_dir, decreasing=False, max_history=args.checkpoint_hist,
    )


def resume(args: argparse.Namespace, model: nn.Module, optimizer: torch.optim.Optimizer,
           model_ema: Optional[ModelEmaV3], lr_scheduler, updates_per_epoch: int) -> int:
    """``--resume``: model and optimizer, then the EMA weights, then the scheduler; returns the epoch to start at."""
    start_epoch = resume_checkpoint(model, args.resume, optimizer=optimizer, loss_scaler=None, log_info=False)
    if model_ema is not None:
        load_checkpoint(model_ema.module, args.resume, use_ema=True)
    if args.sched_on_updates:
        lr_scheduler.step_update(start_epoch * updates_per_epoch)
    else:
        lr_scheduler.step(start_epoch)
    return start_epoch


def amp_autocast(args: argparse.Namespace) -> Callable:
    if not args.amp:
        return nullcontext
    dtype = torch.bfloat16 if args.amp_dtype == 'bfloat16' else torch.float16
    return partial(torch.autocast, device_type=torch.device(args.device).type, dtype=dtype)


def train_one_epoch(
        epoch: int,
        model: nn.Module,
        loader,
        optimizer: torch.optim.Optimizer,
        loss_fn: nn.Module,
        args: argparse.Namespace,
        lr_scheduler=None,
        model_ema: Optional[ModelEmaV3] = None,
        mixup_fn: Optional[Mixup] = None,
) -> List[float]:
    """One epoch of train.py's update loop (no gradient accumulation); the loss of every update."""
    autocast = amp_autocast(args)
    model.train()
    updates_per_epoch = len(loader)
    num_updates = epoch * updates_per_epoch
    losses = []
    optimizer.zero_grad()
    for input, target in loader:
        if not args.prefetcher:
            input, target = input.to(args.device), target.to(args.device)
            if mixup_fn is not None:
                input, target = mixup_fn(input, target)
        if args.channels_last:
            input = input.contiguous(memory_format=torch.channels_last)
        with autocast():
            loss = loss_fn(model(input), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        num_updates += 1
        optimizer.zero_grad()
        if model_ema is not None:
            model_ema.update(model, step=num_updates)
        if lr_scheduler is not None:
            lr_scheduler.step_update(num_updates=num_updates, metric=sum(losses) / len(losses))
    return losses


def validate(model: nn.Module, loader, args: argparse.Namespace) -> float:
    """Top-1 accuracy (%) on the eval loader, as train.py's ``validate``."""
    autocast = amp_autocast(args)
    model.eval()
    top1 = utils.AverageMeter()
    with torch.inference_mode():
        for input, target in loader:
            if args.channels_last:
                input = input.contiguous(memory_format=torch.channels_last)
            with autocast():
                output = model(input)
            acc1, = utils.accuracy(output, target, topk=(1,))
            top1.update(acc1.item(), output.shape[0])
    return top1.avg
