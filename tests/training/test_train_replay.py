"""timm's train.py on our models, replayed in-process (replay.py): the modern CIFAR-10 recipe of each family, with
the command line ``--model-kwargs depth=2 --drop 0.1 --gp avg --layer-decay 0.75 --amp --amp-dtype bfloat16
--grad-checkpointing --channels-last --device cpu`` on a small CIFAR-10 folder, then ``--resume``."""
import argparse
from pathlib import Path

import pytest
import timm
import torch
from timm import utils

import timm_hbf  # noqa: F401  (registers the models)

from .replay import (
    amp_autocast,
    create_ema,
    create_loaders,
    create_model_like_train_py,
    create_optimizer,
    create_saver,
    create_scheduler,
    resume,
    train_args,
    train_one_epoch,
    validate,
)

MODELS = ['vit_hyperbf_tiny', 'vit_qimia_tiny']
RECIPES = Path(timm_hbf.__file__).parent / 'recipes' / 'cifar10' / 'modern'
BATCH = 8


def command_line(model: str, data_dir: Path, **options) -> argparse.Namespace:
    """train.py's args for ``-c <the family's modern recipe>`` and the command line of the module docstring."""
    return train_args(
        str(RECIPES / f"{model.rsplit('_', 1)[0]}.yaml"),
        model=model, data_dir=str(data_dir), model_kwargs=dict(depth=2), drop=0.1, gp='avg', layer_decay=0.75,
        amp=True, amp_dtype='bfloat16', grad_checkpointing=True, channels_last=True, device='cpu', workers=0,
        batch_size=BATCH, epochs=2, warmup_epochs=1, **options,
    )


@pytest.fixture(params=MODELS)
def args(request, cifar10_tiny) -> argparse.Namespace:
    return command_line(request.param, cifar10_tiny)


def run(args: argparse.Namespace, output_dir: Path, stop: int) -> dict:
    """train.py's main() up to epoch ``stop``: the losses of every update per epoch, the model and its EMA."""
    utils.random_seed(args.seed)
    model = create_model_like_train_py(args)
    data = create_loaders(args, model)
    optimizer = create_optimizer(args, model)
    model_ema = create_ema(args, model)
    updates_per_epoch = len(data['loader_train'])
    lr_scheduler, num_epochs = create_scheduler(args, optimizer, updates_per_epoch)
    output_dir.mkdir()
    saver = create_saver(args, model, optimizer, model_ema, str(output_dir))
    start_epoch = resume(args, model, optimizer, model_ema, lr_scheduler, updates_per_epoch) if args.resume else 0
    losses = {}
    for epoch in range(start_epoch, min(stop, num_epochs)):
        # train.py seeds once; seeding every epoch gives a resumed run the batches and augmentations of a whole one
        utils.random_seed(args.seed + epoch)
        losses[epoch] = train_one_epoch(
            epoch, model, data['loader_train'], optimizer, data['train_loss_fn'], args, lr_scheduler=lr_scheduler,
            model_ema=model_ema, mixup_fn=data['mixup_fn'],
        )
        top1 = validate(model_ema.module, data['loader_eval'], args)
        saver.save_checkpoint(epoch, metric=top1)
        lr_scheduler.step(epoch + 1, top1)
    return dict(losses=losses, model=model, model_ema=model_ema, top1=top1, lr=optimizer.param_groups[0]['lr'])


@pytest.fixture(scope='module', params=MODELS)
def runs(request, cifar10_tiny, tmp_path_factory) -> dict:
    """Two epochs in one run; the same in two runs, the second resuming from the first one's checkpoint."""
    tmp = tmp_path_factory.mktemp(request.param)
    args = command_line(request.param, cifar10_tiny)
    full = run(args, tmp / 'full', stop=2)
    first = run(command_line(request.param, cifar10_tiny), tmp / 'first', stop=1)
    resumed = run(command_line(request.param, cifar10_tiny, resume=str(tmp / 'first' / 'last.pth.tar')),
                  tmp / 'resumed', stop=2)
    return dict(args=args, tmp=tmp, full=full, first=first, resumed=resumed)


def options(args: argparse.Namespace, **changes) -> argparse.Namespace:
    return argparse.Namespace(**dict(vars(args), **changes))


def test_create_model_takes_train_py_arguments(args):
    model = create_model_like_train_py(args)
    assert (model.num_classes, model.global_pool, model.grad_checkpointing) == (10, 'avg', True)
    x = torch.randn(2, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    with amp_autocast(args)():
        out = model(x)
    assert out.shape == (2, 10) and out.dtype == torch.bfloat16


@pytest.mark.parametrize('changes, stochastic', [
    (dict(drop=0.), True),  # the recipe's drop path
    (dict(drop_path=None), True),  # --drop 0.1
    (dict(drop=0., drop_path=None), False),
])
def test_drop_and_drop_path_reach_the_model(args, changes, stochastic):
    torch.manual_seed(0)
    model = create_model_like_train_py(options(args, **changes)).train()
    x = torch.randn(64, 3, 32, 32)  # drop path drops whole samples: enough of them that some are dropped
    assert (not torch.equal(model(x), model(x))) == stochastic
    model.eval()
    assert torch.equal(model(x), model(x))


@pytest.mark.parametrize('option', [dict(drop_block=0.1), dict(bn_momentum=0.9)])
def test_options_a_vit_lacks_are_type_errors(args, option):
    with pytest.raises(TypeError):
        create_model_like_train_py(options(args, **option))


def test_data_config_and_loaders(args):
    model = create_model_like_train_py(args)
    data = create_loaders(args, model)
    cfg = data['data_config']
    assert (cfg['input_size'], cfg['crop_pct']) == ((3, 32, 32), 1.0)
    assert cfg['mean'] == tuple(args.mean) and cfg['std'] == tuple(args.std)
    images, targets = next(iter(data['loader_train']))
    assert images.shape == (BATCH, 3, 32, 32) and images.dtype == torch.float32
    assert targets.shape == (BATCH, 10)  # mixup / cutmix soft targets, label-smoothed
    torch.testing.assert_close(targets.sum(-1), torch.ones(BATCH))
    assert len(data['loader_train']) == 5 and len(data['loader_eval']) == 3
    images, targets = next(iter(data['loader_eval']))
    assert images.shape == (BATCH, 3, 32, 32) and targets.dtype == torch.int64


def test_optimizer_with_layer_decay(args):
    model = create_model_like_train_py(args)
    optimizer = create_optimizer(args, model)
    assert type(optimizer).__name__ == 'AdamW'
    assert args.lr == pytest.approx(1e-3 * BATCH / 256)  # lr_base at 256, linear in the batch
    scales = sorted({g['lr_scale'] for g in optimizer.param_groups})
    assert len(scales) >= 4 and scales[-1] == 1.0  # stem, two blocks, head
    decayed = {id(p) for g in optimizer.param_groups if g['weight_decay'] > 0 for p in g['params']}
    params = dict(model.named_parameters())
    assert not any(id(params[n]) in decayed for n in model.no_weight_decay() if n in params)


def test_training_runs_and_checkpoints(runs):
    full = runs['full']
    assert len(full['losses'][0]) == len(full['losses'][1]) == 5
    assert all(torch.isfinite(torch.tensor(loss)).all() for loss in full['losses'].values())
    assert full['lr'] < runs['args'].lr  # warmup, then cosine decay
    output = runs['tmp'] / 'full'
    assert {'last.pth.tar', 'model_best.pth.tar'} <= {p.name for p in output.iterdir()}


def test_resume_continues_with_the_losses_of_an_uninterrupted_run(runs):
    full, first, resumed = runs['full'], runs['first'], runs['resumed']
    assert first['losses'] == {0: full['losses'][0]}
    assert resumed['losses'] == {1: full['losses'][1]}
    for key in ('model', 'model_ema'):
        a, b = (r[key].state_dict() for r in (full, resumed))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), key


def test_create_model_loads_the_checkpoint_with_its_ema_weights(runs):
    args, ema = runs['args'], runs['full']['model_ema'].module
    # built as train.py built it: with --gp avg timm's ViT norms after pooling (fc_norm)
    loaded = timm.create_model(
        args.model, num_classes=10, global_pool=args.gp, checkpoint_path=str(runs['tmp'] / 'full' / 'last.pth.tar'),
        **args.model_kwargs)
    expected = ema.state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in loaded.state_dict().items())
