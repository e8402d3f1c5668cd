"""The train.py recipes, ``timm_hbf/recipes/DATASET/SCHEDULE.yaml`` (``train.py -c``): one per dataset and schedule,
for every model that its header names, timm's ViT of the same size among them; checked through timm's own factories
(train.py ships in timm's git repository only)."""
import argparse
import math
import re
from pathlib import Path

import pytest
import timm
import torch
import yaml
from timm.data import ImageDataset, create_transform, resolve_data_config
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2, scheduler_kwargs

import timm_hbf

RECIPES = Path(timm_hbf.__file__).parent / 'recipes'
PATHS = sorted(RECIPES.glob('*/*.yaml'))
DATASETS = {'cifar10': (10, 32, 'test'), 'cifar100': (100, 32, 'test'), 'tiny_imagenet': (200, 64, 'val')}
BASELINES = ('vit_tiny_patch16_224', 'vit_base_patch16_224')  # timm's ViT, the baseline of each schedule


def recipe_id(path: Path) -> str:
    return f'{path.parent.name}/{path.stem}'


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def models_named(path: Path) -> list:
    """The models of the header's ``train.py -c ... --model NAME`` command lines."""
    return re.findall(r'^#\s+python train\.py -c .* --model (\S+)$', path.read_text(), re.M)


def build(cfg: dict, model: str) -> torch.nn.Module:
    """The model as train.py builds it from the recipe and ``--model``."""
    return timm.create_model(model, num_classes=cfg['num_classes'], drop_path_rate=cfg.get('drop_path'),
                             device='meta', **cfg.get('model_kwargs', {}))


def test_one_recipe_per_dataset_and_schedule():
    assert [recipe_id(p) for p in PATHS] == [
        'cifar10/memo143', 'cifar10/modern', 'cifar10/short', 'cifar10/strong', 'cifar100/memo143', 'cifar100/modern',
        'tiny_imagenet/memo143', 'tiny_imagenet/modern']


@pytest.mark.parametrize('path', PATHS, ids=recipe_id)
def test_every_model_named_builds_for_the_dataset(path):
    cfg = load(path)
    classes, size, val_split = DATASETS[path.parent.name]
    assert (cfg['num_classes'], cfg['train_split'], cfg['val_split'], cfg['img_size']) == (classes, 'train',
                                                                                          val_split, size)
    assert cfg['device_modules'] == ['timm_hbf']  # plain train.py imports timm_hbf, which registers our models
    names = models_named(path)
    assert cfg['model'] in names and len(names) >= 2
    for name in names:
        model = build(cfg, name)
        data_config = resolve_data_config(cfg, model=model)
        assert data_config['input_size'] == (3, size, size) and data_config['crop_pct'] == 1.0, name
        assert model.patch_embed.img_size == (size, size) and model.patch_embed.patch_size == (4, 4), name
        assert model(torch.empty(2, 3, size, size, device='meta')).shape == (2, classes), name


@pytest.mark.parametrize('path', PATHS, ids=recipe_id)
def test_timms_vit_is_the_same_size_as_ours(path):
    cfg = load(path)
    names = models_named(path)
    (vit,) = [build(cfg, name) for name in names if name in BASELINES]
    for name in names:
        ours = build(cfg, name)
        assert (ours.embed_dim, len(ours.blocks)) == (vit.embed_dim, len(vit.blocks)), name
        if name.startswith('vit_hyperbf'):  # HyperBF units replace the ViT's one for one: its parameter count too
            count = [sum(p.numel() for p in m.parameters()) for m in (ours, vit)]
            assert count[0] == pytest.approx(count[1], rel=1e-3)


@pytest.mark.parametrize('path', [p for p in PATHS if p.stem == 'memo143'], ids=recipe_id)
def test_memo_recipe_keeps_the_learning_rate_constant_as_the_authors_code(path):
    """Their cosine scheduler was never stepped: timm's, as train.py builds it, gives the recipe's rate every epoch."""
    cfg = load(path)
    optimizer = create_optimizer_v2(build(cfg, cfg['model']).to_empty(device='cpu'), opt=cfg['opt'], lr=cfg['lr'],
                                    weight_decay=cfg['weight_decay'])
    scheduler, epochs = create_scheduler_v2(optimizer, **scheduler_kwargs(argparse.Namespace(**cfg)))
    rates = set()
    for epoch in range(epochs):
        scheduler.step(epoch)
        rates |= {group['lr'] for group in optimizer.param_groups}
    assert epochs == cfg['epochs'] and rates == {cfg['lr']}


def learning_rate(cfg: dict, global_batch: int) -> float:
    """The learning rate train.py derives from the recipe's ``lr_base`` for a global batch when no ``--lr`` is given."""
    ratio = global_batch / cfg['lr_base_size']
    return cfg['lr_base'] * (ratio ** 0.5 if cfg['lr_base_scale'] == 'sqrt' else ratio)


@pytest.mark.parametrize('path', [p for p in PATHS if p.stem == 'strong'], ids=recipe_id)
def test_strong_recipe_schedules_and_mixes_as_lee_lee_and_song(path):
    """Their 100 epochs at batch 128: AdamW at 1e-3 (2e-3 at batch 512, by the square root), 10 epochs of warmup, then
    cosine, stepped every update, through timm's scheduler as train.py builds and steps it on 45,000 images. Their
    mixing, in train.py's options for timm's Mixup: half the batches left alone, the other half mixup or CutMix (both
    with alpha 1) at even odds, a batch at a time, on label-smoothed targets."""
    cfg = load(path)
    assert (cfg['epochs'], cfg['batch_size'], cfg['opt'], cfg['weight_decay']) == (100, 128, 'adamw', 0.05)
    assert (cfg['mixup'], cfg['cutmix'], cfg['smoothing'], cfg['mixup_prob']) == (1.0, 1.0, 0.1, 0.5)
    assert (cfg.get('mixup_switch_prob', .5), cfg.get('mixup_mode', 'batch')) == (.5, 'batch')  # train.py's defaults
    assert learning_rate(cfg, 128) == pytest.approx(1e-3) and learning_rate(cfg, 512) == pytest.approx(2e-3)
    peak = learning_rate(cfg, cfg['batch_size'])
    optimizer = create_optimizer_v2(build(cfg, cfg['model']).to_empty(device='cpu'), opt=cfg['opt'], lr=peak,
                                    weight_decay=cfg['weight_decay'])
    updates = 45_000 // cfg['batch_size']  # the training loader drops the last, partial batch
    scheduler, epochs = create_scheduler_v2(optimizer, **scheduler_kwargs(argparse.Namespace(**cfg)),
                                            updates_per_epoch=updates)
    rates = []
    for update in range(epochs * updates):
        scheduler.step_update(update)  # train.py: after every update, and nothing at the end of an epoch
        rates.append(optimizer.param_groups[0]['lr'])

    def cosine(epoch: int) -> float:  # over all 100 epochs: the warmup takes the place of its first 10
        return cfg['min_lr'] + (peak - cfg['min_lr']) * (1 + math.cos(math.pi * epoch / epochs)) / 2

    warmup = 10 * updates
    assert epochs == 100 and rates[0] == cfg['warmup_lr'] and max(rates) == pytest.approx(peak, rel=1e-3)
    assert all(a < b for a, b in zip(rates[:warmup - 1], rates[1:warmup]))  # rises with every update
    assert [rates[epoch * updates] for epoch in (10, 50, 90)] == pytest.approx([cosine(e) for e in (10, 50, 90)])
    assert rates[-1] == pytest.approx(cfg['min_lr'], rel=1e-3)


@pytest.mark.parametrize('path', PATHS, ids=recipe_id)
def test_augmentation_runs_on_real_images(path, cifar10_sample):
    """The training augmentation timm's transform factory builds from the recipe, on CIFAR-10 images."""
    cfg = load(path)
    transform = create_transform(
        (3, cfg['img_size'], cfg['img_size']), is_training=True, scale=cfg.get('scale'), ratio=cfg.get('ratio'),
        hflip=cfg['hflip'], color_jitter=cfg.get('color_jitter', 0.4), auto_augment=cfg.get('aa'),
        re_prob=cfg.get('reprob', 0.), interpolation='random', mean=cfg['mean'], std=cfg['std'])
    dataset = ImageDataset(str(cifar10_sample / 'train'), transform=transform)
    torch.manual_seed(0)
    images = torch.stack([dataset[i][0] for i in range(0, len(dataset), 50)])
    assert images.shape == (20, 3, cfg['img_size'], cfg['img_size']) and images.isfinite().all()
    assert images.std() > 0.5  # normalised with the dataset's statistics: about unit spread
