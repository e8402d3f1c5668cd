"""torch's DistributedDataParallel as timm's train.py uses it: two CPU processes, each given half of a batch, take the
gradient of one process on the whole batch and stay in step: every family eager, QIMIA with gradient checkpointing,
and QIMIA compiled before or after wrapping (timm 1.0.27's train.py; 1.0.26's, cut at DDP's buckets)."""
from datetime import timedelta
from pathlib import Path
from typing import Dict, List

import pytest
import timm
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from timm.layers import set_reentrant_ckpt
from torch.nn.parallel import DistributedDataParallel

import timm_hbf  # noqa: F401 (registers the models in the spawned processes)

pytestmark = pytest.mark.slow  # every test spawns two processes; two of them compile

WORLD = 2
BATCH = 8  # BATCH // WORLD images a process
STEPS = 2  # DDP finds a parameter without a gradient only when the next step starts
TIMEOUT = timedelta(minutes=10)  # a process waiting on the other longer than this fails (torch's default: 30)
FAMILIES = ['vit_hyperbf_tiny', 'vit_hyperbf_nrbf_tiny', 'vit_qimia_tiny', 'vit_attnres_tiny', 'vit_attnres_block_tiny']
DEPTH = 3  # crosses a memory block of vit_attnres_block_tiny (two layers)
COMPILED_DEPTH = 1  # compiling takes seconds a layer on a CPU
WRAPPINGS = {
    'compile, then DDP': lambda model: DistributedDataParallel(torch.compile(model)),
    # 1 MB buckets (DDP's smallest; the default 25 MB holds this whole model) cut the graph between the layers
    'DDP, then compile': lambda model: torch.compile(DistributedDataParallel(model, bucket_cap_mb=1)),
}


def _batch() -> tuple:
    images = torch.randn(BATCH, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    return images, torch.arange(BATCH) % 10


def _train_in_two_processes(rank: int, init_file: str, names: List[str], depth: int, wrapping: str, checkpointing: str,
                            out: str) -> None:
    """In process ``rank``, for every model: ``STEPS`` SGD steps of DDP on this process's half of the batch beside a
    copy stepped on the whole batch (``checkpointing``: '', 'non_reentrant' or 'reentrant', of the DDP model); saves
    the first step's gradients of both and every step's parameters."""
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=WORLD, timeout=TIMEOUT)
    torch.set_num_threads(1)
    images, targets = _batch()
    half = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    saved: Dict[str, dict] = {}
    set_reentrant_ckpt(checkpointing == 'reentrant')
    for name in names:
        torch.manual_seed(0)
        model = timm.create_model(name, depth=depth)
        whole = timm.create_model(name, depth=depth)
        whole.load_state_dict(model.state_dict())
        model.set_grad_checkpointing(bool(checkpointing))
        wrapped = WRAPPINGS[wrapping](model) if wrapping else DistributedDataParallel(model)
        runs = [(wrapped, model, images[half], targets[half]), (whole, whole, images, targets)]
        optimizers = [torch.optim.SGD(m.parameters(), lr=1e-2) for _, m, _, _ in runs]
        record = saved[name] = {'params': []}
        for step in range(STEPS):
            for (run, module, x, y), optimizer, key in zip(runs, optimizers, ('ddp_grads', 'whole_grads')):
                F.cross_entropy(run(x), y).backward()
                if step == 0:
                    record[key] = {n: p.grad for n, p in module.named_parameters()}  # zero_grad sets new ones
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            record['params'].append({n: p.detach().clone() for n, p in model.named_parameters()})
    torch.save(saved, Path(out) / f'rank{rank}.pt')
    dist.destroy_process_group()


def train_in_two_processes(tmp_path: Path, names: List[str], depth: int, wrapping: str = '',
                           checkpointing: str = '') -> List[Dict[str, dict]]:
    """What :func:`_train_in_two_processes` saved, rank by rank."""
    args = (str(tmp_path / 'init'), names, depth, wrapping, checkpointing, str(tmp_path))
    mp.spawn(_train_in_two_processes, args=args, nprocs=WORLD)
    return [torch.load(tmp_path / f'rank{rank}.pt') for rank in range(WORLD)]


def assert_trained_in_step(ranks: List[Dict[str, dict]], name: str) -> None:
    """Both processes' first gradient is one process's on the whole batch (the mean of the halves' mean losses), and
    their parameters are the same after every step."""
    for rank, saved in enumerate(ranks):
        grads, whole = saved[name]['ddp_grads'], saved[name]['whole_grads']
        assert grads.keys() == whole.keys()
        for n in grads:
            torch.testing.assert_close(grads[n], whole[n], rtol=1e-4, atol=1e-6, msg=f'{name} rank {rank}: {n}')
    for step, (params, others) in enumerate(zip(*(saved[name]['params'] for saved in ranks))):
        for n in params:
            assert torch.equal(params[n], others[n]), f'{name}: {n} differs between the processes after step {step}'


@pytest.mark.parametrize('names, depth, wrapping, checkpointing', [
    (FAMILIES, DEPTH, '', ''),
    *((['vit_qimia_tiny'], DEPTH, '', checkpointing) for checkpointing in ('non_reentrant', 'reentrant')),
    *((['vit_qimia_tiny'], COMPILED_DEPTH, wrapping, '') for wrapping in WRAPPINGS),
], ids=['every_family', 'qimia_non_reentrant_checkpointing', 'qimia_reentrant_checkpointing',
        *(f'qimia_{wrapping}' for wrapping in WRAPPINGS)])
def test_two_processes_train_as_one_on_the_whole_batch(tmp_path, names, depth, wrapping, checkpointing):
    if wrapping:
        size = sum(p.numel() * p.element_size() for p in timm.create_model(names[0], depth=depth).parameters())
        assert size > 2 * 2 ** 20, 'the model fits in two 1 MB buckets: the graph would be cut once at most'
    ranks = train_in_two_processes(tmp_path, names, depth, wrapping, checkpointing)
    for name in names:
        assert_trained_in_step(ranks, name)
