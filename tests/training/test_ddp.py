"""DDP on two CPU processes (torchrun, gloo), launched through ``torchrun ... -m timm_hbf.run``: ddp_worker.py."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import timm_hbf  # noqa: F401  (registers the models)

MODELS = ['vit_hyperbf_tiny', 'vit_qimia_tiny']
WORKER = Path(__file__).with_name('ddp_worker.py')


@pytest.fixture(scope='module')
def ranks(cifar10_tiny, tmp_path_factory) -> Path:
    """What each of the two ranks saved after training every model."""
    output = tmp_path_factory.mktemp('ddp')
    cmd = [
        sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node', '2',
        '-m', 'timm_hbf.run', str(WORKER), str(cifar10_tiny), str(output), *MODELS,
    ]
    env = dict(os.environ, TIMM_HBF_NO_AUTOLOAD='1', OMP_NUM_THREADS='1')  # the models come from timm_hbf.run
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-5000:]
    return output


def load(ranks: Path, model: str):
    return [torch.load(ranks / f'{model}.rank{r}.pt') for r in (0, 1)]


@pytest.mark.parametrize('model', MODELS)
def test_parameters_stay_identical_across_ranks(ranks, model):
    rank0, rank1 = load(ranks, model)
    assert rank0['losses'] != rank1['losses']  # each rank trains on its own part of the data
    assert rank0['state'].keys() == rank1['state'].keys()
    assert all(torch.equal(v, rank1['state'][k]) for k, v in rank0['state'].items())


@pytest.mark.parametrize('model', MODELS)
def test_every_parameter_gets_a_gradient(ranks, model):
    assert [r['no_grad'] for r in load(ranks, model)] == [[], []]
