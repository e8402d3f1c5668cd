"""Both families on CUDA, at the model level: the same weights give the logits and gradients of the CPU in float32 and
follow them under bf16 autocast; ``torch.compile`` (whole, by region, past a graph break) matches eager; a checkpoint
trained on CUDA loads on the CPU with the same weights and logits."""
import copy
from typing import List, Optional, Tuple

import pytest
import timm
import torch
import torch.nn.functional as F

import timm_hbf  # noqa: F401  (registers the models)

from ..helpers import run_as
from .device import COMPILE_BACKEND, DEVICE, gradients_error, needs_device, relative_error

pytestmark = needs_device

MODELS = {
    'hyperbf': ('vit_hyperbf_tiny', dict(depth=2)),
    'qimia': ('vit_qimia_tiny', dict(depth=2)),
    'qimia_key_norm_block_memory': ('vit_qimia_tiny', dict(depth=4, key_norm=True, memory_block_size=2)),
    'attnres': ('vit_attnres_block_tiny', dict(depth=4)),
}
FAMILIES = ['hyperbf', 'qimia', 'attnres']
FLOAT32_TOLERANCE = 1e-3  # relative, norm-wise: a wrong path is off by order 1
# bf16 autocast against float32, relative and norm-wise: logits, and gradients per model, about 3 times what bf16
# autocast gave on the CPU (logits 0.005 to 0.010; gradients 0.005 for HyperBF, 0.07 to 0.08 for QIMIA, 0.013 for
# Block AttnRes)
BF16_LOGITS_TOLERANCE = 3e-2
BF16_GRADIENTS_TOLERANCE = {'hyperbf': 2e-2, 'qimia': 0.25, 'qimia_key_norm_block_memory': 0.25, 'attnres': 4e-2}


def make_model(case: str) -> torch.nn.Module:
    """The model of ``case`` on the CPU, its parameters moved off their init (QIMIA's queries start at zero, where
    keys get no gradient)."""
    name, kwargs = MODELS[case]
    torch.manual_seed(0)
    model = timm.create_model(name, **kwargs)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model


def images(batch: int = 8) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, 3, 32, 32, generator=g), torch.arange(batch) % 10


def training_pass(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                  bf16: bool = False) -> Tuple[torch.Tensor, List[Optional[torch.Tensor]]]:
    """Logits and parameter gradients of cross-entropy in training mode (on the model's device)."""
    device = next(model.parameters()).device
    model.train()
    model.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(x.to(device))
    F.cross_entropy(logits.float(), y.to(device)).backward()
    return logits.detach(), [p.grad for p in model.parameters()]


def assert_gradients_close(actual, expected, tolerance: float) -> None:
    assert [a is None for a in actual] == [e is None for e in expected]
    assert gradients_error([a for a in actual if a is not None], [e for e in expected if e is not None]) < tolerance


@torch.no_grad()
def eval_logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.eval()
    return model(x.to(next(model.parameters()).device))


@pytest.mark.parametrize('case', MODELS)
def test_cuda_gives_the_logits_and_gradients_of_the_cpu_in_float32(case):
    cpu = make_model(case)
    cuda = copy.deepcopy(cpu).to(DEVICE)
    x, y = images()
    assert relative_error(eval_logits(cuda, x), eval_logits(cpu, x)) < FLOAT32_TOLERANCE
    logits, grads = training_pass(cuda, x, y)
    expected_logits, expected_grads = training_pass(cpu, x, y)
    assert relative_error(logits, expected_logits) < FLOAT32_TOLERANCE
    assert_gradients_close(grads, expected_grads, FLOAT32_TOLERANCE)


@pytest.mark.parametrize('case', MODELS)
def test_bf16_autocast_on_cuda_follows_float32_on_the_cpu(case):
    cpu = make_model(case)
    cuda = copy.deepcopy(cpu).to(DEVICE)
    x, y = images()
    logits, grads = training_pass(cuda, x, y, bf16=True)
    expected_logits, expected_grads = training_pass(cpu, x, y)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    assert relative_error(logits, expected_logits) < BF16_LOGITS_TOLERANCE
    assert_gradients_close(grads, expected_grads, BF16_GRADIENTS_TOLERANCE[case])


@pytest.mark.parametrize('family', FAMILIES)
def test_whole_graph_compile_matches_eager(family):
    """fullgraph=True fails on any graph break. Evaluation in float32 against eager; a bf16 training pass (what
    users run) against float32 on the CPU, as close as eager's own."""
    torch._dynamo.reset()
    cpu = make_model(family)
    model = copy.deepcopy(cpu).to(DEVICE)
    compiled = run_as('compiled_whole', model, None, COMPILE_BACKEND)
    x, y = images()
    assert relative_error(eval_logits(compiled, x), eval_logits(model, x)) < FLOAT32_TOLERANCE
    expected_logits, expected_grads = training_pass(cpu, x, y)
    logits, grads = training_pass(compiled, x, y, bf16=True)
    assert relative_error(logits, expected_logits) < BF16_LOGITS_TOLERANCE
    assert_gradients_close(grads, expected_grads, BF16_GRADIENTS_TOLERANCE[family])


@pytest.mark.parametrize('mode', ['compiled_by_region', 'compiled_past_a_graph_break'])
@pytest.mark.parametrize('family', ['qimia', 'attnres'])
def test_regional_compilation_and_a_graph_break_give_the_eager_model(family, mode):
    """Each block compiled on its own, or the whole model with a graph break inside: the eager logits and gradients
    in float32 (the depth memory passes between compiled and eager code unchanged)."""
    torch._dynamo.reset()
    model = make_model(family).to(DEVICE)
    compiled = run_as(mode, copy.deepcopy(model), None, COMPILE_BACKEND)
    x, y = images()
    assert relative_error(eval_logits(compiled, x), eval_logits(model, x)) < FLOAT32_TOLERANCE
    torch.manual_seed(0)
    logits, grads = training_pass(compiled, x, y)
    torch.manual_seed(0)
    expected_logits, expected_grads = training_pass(model, x, y)
    assert relative_error(logits, expected_logits) < FLOAT32_TOLERANCE
    assert_gradients_close(grads, expected_grads, FLOAT32_TOLERANCE)


@pytest.mark.parametrize('family', FAMILIES)
def test_a_checkpoint_trained_on_cuda_loads_on_the_cpu(family, tmp_path):
    """A few AdamW steps under bf16 autocast on CUDA, saved as train.py saves; timm loads it on the CPU with
    ``checkpoint_path`` and gives the weights and the float32 logits of the CUDA model."""
    name, kwargs = MODELS[family]
    model = make_model(family).to(DEVICE)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = images()
    for _ in range(3):
        training_pass(model, x, y, bf16=True)
        optimizer.step()
    trained = model.state_dict()
    assert any(not torch.equal(trained[k], start[k]) for k in start)
    torch.save(dict(arch=name, epoch=0, state_dict=trained), tmp_path / 'checkpoint.pth.tar')

    loaded = timm.create_model(name, checkpoint_path=str(tmp_path / 'checkpoint.pth.tar'), **kwargs)
    assert loaded.state_dict().keys() == trained.keys()
    assert all(torch.equal(loaded.state_dict()[k], v.cpu()) for k, v in trained.items())
    assert relative_error(eval_logits(loaded, x), eval_logits(model, x)) < FLOAT32_TOLERANCE
