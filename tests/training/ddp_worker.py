"""One rank of test_ddp.py: a few DDP updates of train.py's replay for each model named on the command line.

    python -m torch.distributed.run --standalone --nproc_per_node 2 -m timm_hbf.run ddp_worker.py DATA OUT MODEL...

Each rank saves ``OUT/MODEL.rank<r>.pt``: its losses, the parameters after the updates, and the names of the
parameters that had no gradient after a backward pass. The models come from ``timm_hbf.run`` (the test turns the
import hook off), the process group from timm's ``init_distributed_device`` (gloo on CPU).
"""
import argparse
import sys
from itertools import islice
from pathlib import Path

import torch
from replay import amp_autocast, create_loaders, create_model_like_train_py, create_optimizer, train_args  # its folder
from timm import utils
from torch.nn.parallel import DistributedDataParallel

RECIPES = Path(__file__).resolve().parents[2] / 'timm_hbf' / 'recipes' / 'cifar10' / 'modern'
UPDATES = 3


def train(model_name: str, data_dir: str, output_dir: Path, dist: argparse.Namespace) -> None:
    args = train_args(
        str(RECIPES / f"{model_name.rsplit('_', 1)[0]}.yaml"),
        model=model_name, data_dir=data_dir, model_kwargs=dict(depth=2), amp=True, amp_dtype='bfloat16',
        device='cpu', workers=0, batch_size=4, no_prefetcher=True,
    )
    for key in ('distributed', 'world_size', 'rank', 'local_rank'):
        setattr(args, key, getattr(dist, key))
    utils.random_seed(args.seed, args.rank)  # as train.py: each rank starts from its own init, DDP broadcasts rank 0's
    model = create_model_like_train_py(args)
    data = create_loaders(args, model)
    optimizer = create_optimizer(args, model)
    ddp = DistributedDataParallel(model)  # train.py passes device_ids=[device], which DDP refuses for CPU modules
    losses, no_grad = [], set()
    for input, target in islice(data['loader_train'], UPDATES):
        input, target = data['mixup_fn'](input, target)
        with amp_autocast(args)():
            loss = data['train_loss_fn'](ddp(input), target)
        loss.backward()
        no_grad |= {n for n, p in model.named_parameters() if p.grad is None}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    torch.save(dict(losses=losses, state=model.state_dict(), no_grad=sorted(no_grad)),
               output_dir / f'{model_name}.rank{args.rank}.pt')


if __name__ == '__main__':
    data_dir, output_dir, *models = sys.argv[1:]
    dist = argparse.Namespace(device='cpu')
    utils.init_distributed_device(dist)
    for name in models:
        train(name, data_dir, Path(output_dir), dist)
    torch.distributed.destroy_process_group()
