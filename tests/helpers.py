"""Shared test helpers."""
import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, List, Tuple

import pytest
import torch
from safetensors.torch import load_file
from torch.overrides import TorchFunctionMode

ROOT = Path(__file__).resolve().parents[1]  # the repository
BUILD_BACKEND = ('hatchling', 'editables')  # pyproject.toml's build backend, and what its editable installs need


def require_build_backend(task: str) -> None:
    """Skip the test where the build backend is missing, naming the install that brings it; fail on CI (``CI``
    set), where the test extra is installed."""
    missing = [name for name in BUILD_BACKEND if importlib.util.find_spec(name) is None]
    if missing:
        reason = (f'{task} without the package index needs its build backend in this environment, and '
                  f'{" and ".join(missing)} is missing: pip install -e ".[test]" (the test extra has it)')
        if os.environ.get('CI'):
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)


def build_distribution(target: str, folder: Path) -> Path:
    """The project's ``'wheel'`` or ``'sdist'``, built into ``folder`` with this environment's build backend (no
    package index needed); skips or fails as :func:`require_build_backend` says."""
    require_build_backend(f'building the {target}')
    build = [sys.executable, '-m', 'hatchling', 'build', '--target', target, '--directory', str(folder)]
    proc = subprocess.run(build, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f'$ {" ".join(build)}\n{proc.stdout}{proc.stderr}'
    (built,) = folder.iterdir()
    return built


def install(env: Path, source: Path, editable: bool = False) -> Path:
    """``source`` (a built wheel, or the repository for an editable install) installed into a new virtual environment
    ``env`` with pip's ``--no-deps --no-build-isolation`` (built with this environment's backend: no package index
    needed). ``env`` sees torch, timm and the rest through a ``.pth`` file naming this environment's site-packages,
    whose own ``.pth`` files (among them this environment's install of timm-hbf) it does not run."""
    require_build_backend('installing timm-hbf')
    venv.create(env, with_pip=False)
    site_packages = subprocess.run(
        [str(env / 'bin' / 'python'), '-c', 'import sysconfig; print(sysconfig.get_paths()["purelib"])'],
        capture_output=True, text=True, check=True).stdout.strip()
    # the name sorts before the .pth files of the install
    Path(site_packages, '0_parent_env.pth').write_text(sysconfig.get_paths()['purelib'] + '\n')
    cmd = [sys.executable, '-m', 'pip', '--python', str(env / 'bin' / 'python'), 'install', '--no-deps',
           '--no-build-isolation', '--quiet', *(['--editable'] if editable else []), str(source)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f'$ {" ".join(cmd)}\n{proc.stdout}{proc.stderr}'
    return env


def run_in(env: Path, *args: str, cwd: Path, timeout: float = 120, **extra_env: str) -> subprocess.CompletedProcess:
    """``env``'s ``bin/ARGS[0]`` (``python``, or a command the install put there) run with ``ARGS[1:]`` in ``cwd``,
    ``extra_env`` added to the environment."""
    return subprocess.run([str(env / 'bin' / args[0]), *args[1:]], cwd=cwd, env=dict(os.environ, **extra_env),
                          capture_output=True, text=True, timeout=timeout)


class ShapeRecorder(TorchFunctionMode):
    """Records the shape of every tensor that torch functions return while active."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: List[torch.Size] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(t.shape)
        return out


def layer_normed(*shape: int, seed: int = 1234) -> torch.Tensor:
    """Random tokens after a LayerNorm without affine, as HyperBF layers see them in a pre-norm block."""
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.layer_norm(torch.randn(*shape, generator=g) * 3 + 1, shape[-1:])


def dropout_matches_its_expectation(layer: torch.nn.Module, plain: torch.nn.Module, x: torch.Tensor) -> None:
    """``layer`` with dropout, ``plain`` the same without, ``x`` one input repeated along the batch (a draw each): in
    training every draw is another and their mean is ``plain``'s output (within 5 standard errors); in evaluation
    ``layer`` gives that output."""
    torch.manual_seed(0)
    with torch.no_grad():
        expected = plain(x[:1])[0]
        draws = layer.train()(x)
        torch.testing.assert_close(layer.eval()(x[:1])[0], expected)
    assert not torch.allclose(draws[0], draws[1])
    standard_error = draws.std(0) / draws.shape[0] ** .5
    assert ((draws.mean(0) - expected).abs() < 5 * standard_error + 1e-6).all()


def compiled_matches_eager(model: torch.nn.Module, x: torch.Tensor, backend: str) -> None:
    """``torch.compile(model, fullgraph=True)`` (which raises on any graph break) gives the eager outputs in eval
    under ``torch.inference_mode`` (as timm's train.py evaluates, and its validate.py and inference.py run), and the
    eager loss and gradients in a training step (the same seed, so the same dropout masks)."""
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    model.eval()
    with torch.inference_mode():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
    model.train()
    target = torch.arange(x.shape[0]) % model.num_classes
    results = []
    for run in (compiled, model):
        torch.manual_seed(0)
        loss = torch.nn.functional.cross_entropy(run(x), target)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
        model.zero_grad(set_to_none=True)
    (loss, grads), (eager_loss, eager_grads) = results
    torch.testing.assert_close(loss, eager_loss, rtol=1e-4, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], rtol=1e-3, atol=1e-5, msg=name)


def saved_activation_bytes(module, x):
    """Bytes of the distinct tensors (parameters aside) that autograd keeps for the backward pass of ``module(x)``."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(storages.values())


LEGACY_DIR = Path(__file__).parent / 'data'


def legacy_checkpoint(case: str) -> Tuple[str, Dict[str, Any], Dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """A checkpoint written by timm_hbf 0.1.0 (``tests/data``): model name, model kwargs, state dict, and two
    images with the logits that version gave for them in eval mode."""
    spec = json.loads((LEGACY_DIR / 'legacy_checkpoints.json').read_text())['cases'][case]
    tensors = load_file(LEGACY_DIR / f'{case}.safetensors')
    state_dict = {k[len('state_dict.'):]: v for k, v in tensors.items() if k.startswith('state_dict.')}
    return spec['model'], spec['kwargs'], state_dict, tensors['test.images'], tensors['test.logits']


def load_module(path: Path) -> ModuleType:
    """A script of the repository (``benchmarks/``, ``examples/``) imported as a module named after its file."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
