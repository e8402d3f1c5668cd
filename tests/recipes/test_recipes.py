"""The train.py recipes of timm_hbf/recipes/DATASET/RECIPE/FAMILY.yaml (for ``train.py -c``)."""
from pathlib import Path

import pytest
import timm
import torch
import yaml
from timm.data import resolve_data_config
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2

import timm_hbf

RECIPES = Path(timm_hbf.__file__).parent / 'recipes'
TRAIN_PY_OPTIONS = {
    line for line in (Path(__file__).parent / 'train_py_options.txt').read_text().splitlines()
    if line and not line.startswith('#')
}
DATASETS = {'cifar10': (10, 32, 'test'), 'cifar100': (100, 32, 'test'), 'tiny_imagenet': (200, 64, 'val')}
FAMILIES = ('vit_hyperbf', 'vit_qimia', 'vit')  # ours, and timm's ViT of the same size as the baseline
PATHS = sorted(RECIPES.glob('*/*/*.yaml'))


def load(path: Path) -> dict:
    with open(path) as f:
        return yaml.safe_load(f)


def recipe_id(path: Path) -> str:
    return '/'.join(path.relative_to(RECIPES).with_suffix('').parts)


def of(recipe: str):
    return [p for p in PATHS if p.parts[-2] == recipe]


def build(cfg: dict) -> torch.nn.Module:
    return timm.create_model(cfg['model'], num_classes=cfg['num_classes'], drop_path_rate=cfg.get('drop_path'),
                             device='meta', **cfg.get('model_kwargs', {}))


def test_every_dataset_recipe_and_family():
    assert [recipe_id(p) for p in PATHS] == sorted(
        f'{d}/{r}/{f}' for d in DATASETS for r in ('memo143', 'modern') for f in FAMILIES)


@pytest.mark.parametrize('path', PATHS, ids=recipe_id)
def test_keys_are_train_py_options(path):
    assert set(load(path)) <= TRAIN_PY_OPTIONS


@pytest.mark.parametrize('path', PATHS, ids=recipe_id)
def test_model_and_data_agree(path):
    cfg = load(path)
    classes, size, val_split = DATASETS[path.parts[-3]]
    assert (cfg['num_classes'], cfg['train_split'], cfg['val_split']) == (classes, 'train', val_split)
    assert cfg.get('device_modules') == (None if path.stem == 'vit' else ['timm_hbf'])  # plain train.py finds ours
    model = build(cfg)
    data_config = resolve_data_config(cfg, model=model)
    assert data_config['input_size'] == (3, size, size) and data_config['crop_pct'] == 1.0
    assert model.patch_embed.img_size == (size, size) and model.patch_embed.patch_size == (4, 4)
    assert model(torch.empty(2, 3, size, size, device='meta')).shape == (2, classes)


@pytest.mark.parametrize('path', of('memo143'), ids=recipe_id)
def test_memo_recipe_keeps_the_learning_rate_constant_as_the_authors_code(path):
    """Their cosine scheduler was never stepped: timm's scheduler built from the recipe gives its learning rate at
    every epoch, with no warmup."""
    cfg = load(path)
    model = build(cfg).to_empty(device='cpu')
    optimizer = create_optimizer_v2(model, opt=cfg['opt'], lr=cfg['lr'], weight_decay=cfg['weight_decay'])
    scheduler, epochs = create_scheduler_v2(optimizer, sched=cfg['sched'], num_epochs=cfg['epochs'],
                                            decay_epochs=cfg.get('decay_epochs', 90), decay_rate=cfg['decay_rate'],
                                            warmup_epochs=cfg['warmup_epochs'])
    rates = set()
    for epoch in range(epochs):
        scheduler.step(epoch)
        rates |= {group['lr'] for group in optimizer.param_groups}
    assert rates == {cfg['lr']}


@pytest.mark.parametrize('path', [p for p in PATHS if p.stem != 'vit'],
                         ids=recipe_id)
def test_the_vit_baseline_has_the_dimensions_of_the_family(path):
    ours, vit = build(load(path)), build(load(path.with_name('vit.yaml')))
    assert (ours.embed_dim, len(ours.blocks), ours.num_classes) == (vit.embed_dim, len(vit.blocks), vit.num_classes)
    if path.stem == 'vit_hyperbf':  # the same parameter count too: HyperBF units replace the MLP one for one
        count = [sum(p.numel() for p in m.parameters()) for m in (ours, vit)]
        assert count[0] == pytest.approx(count[1], rel=1e-3)
