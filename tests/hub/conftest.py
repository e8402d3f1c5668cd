"""Fixtures of the Hub tests: the loopback Hub (one per session), a real train.py run on CIFAR-10 images, and Hub
clients in this process or in fresh ones."""
import argparse
import hashlib
import os
import random
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import timm
import torch
import yaml
from huggingface_hub import constants
from timm.data import ImageDataset, create_transform, resolve_data_config
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.utils import CheckpointSaver, ModelEmaV3, accuracy, update_summary

from timm_hbf.hub import read_train_output, write_repo_folder

from .fake_hub import TOKEN, FakeHub

PULL_SCRIPT = Path(__file__).with_name('pull_logits.py')
REPO_ID = 'cifar/vit-hyperbf-tiny'
HYPERBF, QIMIA = 'vit_hyperbf_tiny', 'vit_qimia_tiny'  # one model of each family
CIFAR10_LABELS = ['airplane', 'automobile', 'bird', 'cat', 'deer', 'dog', 'frog', 'horse', 'ship', 'truck']


@pytest.fixture(scope='session')
def hub():
    """The loopback Hub, serving on 127.0.0.1 for the whole session."""
    with FakeHub() as hub:
        yield hub


@pytest.fixture
def fresh_hub(hub):
    """The session's Hub with no faults and an empty request log (repos of earlier tests stay)."""
    hub.reset()
    yield hub
    hub.reset()


@pytest.fixture
def hub_cache(fresh_hub, tmp_path, monkeypatch):
    """huggingface_hub in this process talking to the loopback Hub, logged out; the path of its cache, empty."""
    return use_hub(fresh_hub, tmp_path, monkeypatch)


def use_hub(hub: FakeHub, home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point huggingface_hub in this process at ``hub``, logged out, with an empty cache in ``home``; returns the
    cache. The client reads its settings from the environment at import, so they are set on
    ``huggingface_hub.constants``."""
    cache = home / 'hf-cache'
    for name, value in dict(
            ENDPOINT=hub.endpoint,
            HUGGINGFACE_CO_URL_TEMPLATE=hub.endpoint + '/{repo_id}/resolve/{revision}/{filename}',
            HF_HUB_CACHE=str(cache),
            HF_TOKEN_PATH=str(home / 'no-token'),
            HF_HUB_OFFLINE=False,
            HF_HUB_DISABLE_XET=True,
    ).items():
        monkeypatch.setattr(constants, name, value)
    monkeypatch.delenv('HF_TOKEN', raising=False)
    return cache


@pytest.fixture
def no_backoff(monkeypatch):
    """Retry without waiting: the client backs off for seconds between retries."""
    monkeypatch.setattr(time, 'sleep', lambda seconds: None)


@pytest.fixture(scope='session')
def train_run(cifar10_sample, tmp_path_factory) -> Path:
    """A train.py output folder of a short real training run of vit_hyperbf_tiny (see :func:`train_like_train_py`),
    trained in one thread: a checks-only run, and far faster than two threads on a busy machine."""
    return _train_in_one_thread(cifar10_sample, tmp_path_factory.mktemp('output') / 'train' / 'hbf-cifar10', HYPERBF)


@pytest.fixture(scope='session')
def qimia_train_run(cifar10_sample, tmp_path_factory) -> Path:
    """The same for vit_qimia_tiny."""
    return _train_in_one_thread(cifar10_sample, tmp_path_factory.mktemp('output') / 'train' / 'qimia-cifar10', QIMIA)


@pytest.fixture(scope='session')
def avg_pool_train_run(cifar10_sample, tmp_path_factory) -> Path:
    """A shorter run of vit_hyperbf_tiny trained with train.py's ``--gp avg``: average pooling, and so timm's
    ``fc_norm`` after it in place of ``norm``."""
    return _train_in_one_thread(cifar10_sample, tmp_path_factory.mktemp('output') / 'train' / 'hbf-avg-cifar10',
                                HYPERBF, gp='avg', epochs=2, steps=1)


def _train_in_one_thread(data: Path, output: Path, model: str, **kwargs) -> Path:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train_like_train_py(data, output, model, **kwargs)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope='session')
def repo_folder(train_run, tmp_path_factory) -> Path:
    """What ``timm-hbf push`` of ``train_run`` would push, with the CIFAR-10 label names (a dry run)."""
    folder = tmp_path_factory.mktemp('dry-run') / 'repo'
    return write_repo_folder(read_train_output(train_run), folder, REPO_ID, label_names=CIFAR10_LABELS)


def train_like_train_py(data: Path, output: Path, model: str = HYPERBF, epochs: int = 4, steps: int = 3,
                        batch_size: int = 32, gp: Optional[str] = None) -> Path:
    """Train ``model`` (2 blocks) for a few steps per epoch on CIFAR-10 images, leaving what timm's train.py
    leaves: checkpoints of CheckpointSaver (weights, EMA weights, optimizer, the argument namespace), ``args.yaml``
    and ``summary.csv`` (written by ``update_summary``, EMA metrics when there is an EMA, as train.py does). ``gp``
    is train.py's ``--gp``, its global pooling (None: the model's default)."""
    args = argparse.Namespace(
        data_dir=str(data), dataset='', train_split='train', val_split='test', model=model,
        model_kwargs={'depth': 2}, pretrained=False, num_classes=10, gp=gp, img_size=None, in_chans=None,
        input_size=None, crop_pct=None, mean=None, std=None, interpolation='', epochs=epochs, batch_size=batch_size,
        opt='adamw', lr=1e-3, weight_decay=0.05, sched='cosine', warmup_epochs=0, smoothing=0.1, drop=0.0,
        drop_path=0.05, model_ema=True, model_ema_decay=0.5, seed=0, amp=False, output=str(output.parent),
        experiment=output.name, eval_metric='top1', checkpoint_hist=2,
    )
    output.mkdir(parents=True)
    (output / 'args.yaml').write_text(yaml.safe_dump(args.__dict__, default_flow_style=False))
    random.seed(args.seed)  # timm's augmentations draw from random
    torch.manual_seed(args.seed)
    model = timm.create_model(
        args.model, num_classes=args.num_classes, drop_rate=args.drop, drop_path_rate=args.drop_path,
        global_pool=args.gp, **args.model_kwargs)  # timm drops the arguments that are None
    ema = ModelEmaV3(model, decay=args.model_ema_decay)
    optimizer = create_optimizer_v2(model, opt=args.opt, lr=args.lr, weight_decay=args.weight_decay)
    scheduler, _ = create_scheduler_v2(optimizer, sched=args.sched, num_epochs=epochs, warmup_epochs=args.warmup_epochs)
    data_config = resolve_data_config(vars(args), model=model)
    train_set = ImageDataset(str(data / args.train_split), transform=create_transform(**data_config, is_training=True))
    eval_set = ImageDataset(str(data / args.val_split), transform=create_transform(**data_config))
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(args.seed))
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(train_set, order[:steps * batch_size].tolist()),
                                         batch_size=batch_size)
    eval_loader = torch.utils.data.DataLoader(torch.utils.data.Subset(eval_set, range(0, len(eval_set), 5)),
                                              batch_size=40)
    saver = CheckpointSaver(model, optimizer, args=args, model_ema=ema, checkpoint_dir=str(output),
                            recovery_dir=str(output), max_history=args.checkpoint_hist)
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=args.smoothing)
    for epoch in range(epochs):
        model.train()
        losses = []
        for images, targets in loader:
            loss = loss_fn(model(images), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ema.update(model, step=epoch * steps + len(losses))
            losses.append(loss.item())
        eval_metrics = _evaluate(ema.module, eval_loader)
        update_summary(epoch, OrderedDict(loss=sum(losses) / len(losses)), eval_metrics, str(output / 'summary.csv'),
                       lr=optimizer.param_groups[0]['lr'], write_header=epoch == 0)
        saver.save_checkpoint(epoch, metric=eval_metrics[args.eval_metric])
        scheduler.step(epoch + 1)
    return output


@torch.no_grad()
def _evaluate(model: torch.nn.Module, loader) -> Dict[str, float]:
    model.eval()
    logits, targets = zip(*[(model(images), t) for images, t in loader])
    logits, targets = torch.cat(logits), torch.cat(targets)
    top1, top5 = accuracy(logits, targets, topk=(1, 5))
    return OrderedDict(loss=torch.nn.functional.cross_entropy(logits, targets).item(), top1=top1.item(),
                       top5=top5.item())


def hub_env(hub: FakeHub, home: Path, **extra: str) -> Dict[str, str]:
    """The environment of a fresh process using the loopback Hub, with its own HF_HOME and no token unless given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith('HF_')}
    env.update(
        HF_ENDPOINT=hub.endpoint, HF_HOME=str(home), HF_HUB_DISABLE_TELEMETRY='1', HF_HUB_DISABLE_PROGRESS_BARS='1',
        NO_PROXY='127.0.0.1,localhost', **extra,
    )
    return env


def run_push(hub: FakeHub, home: Path, args: List[str], **extra: str) -> subprocess.CompletedProcess:
    """``timm-hbf push ARGS`` (the installed command) in a fresh process, logged in with a token that may write."""
    command = [str(Path(sys.executable).with_name('timm-hbf')), 'push', *args]
    env = hub_env(hub, home, HF_TOKEN=TOKEN, **extra)
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


def run_pull(hub: FakeHub, home: Path, model_name: str, images: Path, out: Path, **extra: str) -> dict:
    """``timm.create_model(model_name, pretrained=True)`` in a fresh process; its logits on ``images`` and its
    weights (see ``pull_logits.py``)."""
    proc = subprocess.run([sys.executable, str(PULL_SCRIPT), model_name, str(images), str(out)],
                          env=hub_env(hub, home, **extra), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return torch.load(out, weights_only=True)


def assert_clean_cache(cache: Path) -> None:
    """No partial download in the Hub cache, no dangling link, and every blob holds what its name (the ETag the Hub
    announced: sha256 for LFS files, git blob id for the others) says."""
    assert not [p for p in cache.rglob('*') if p.name.endswith('.incomplete')]
    for blob in cache.glob('models--*/blobs/*'):
        data = blob.read_bytes()
        sha = hashlib.sha256(data) if len(blob.name) == 64 else hashlib.sha1(b'blob %d\0' % len(data) + data)
        assert sha.hexdigest() == blob.name, blob
    assert all(p.resolve().exists() for p in cache.glob('models--*/snapshots/**/*')), 'dangling link'


def load_checkpoint(path: Path) -> dict:
    """A train.py checkpoint, read as timm reads it (weights only, the argument namespace allowed)."""
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(path, map_location='cpu', weights_only=True)


def assert_same_tensors(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
