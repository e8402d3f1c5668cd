"""Shared test helpers."""
import copy
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

import timm
import torch
from safetensors.torch import load_file
from torch.overrides import TorchFunctionMode

ROOT = Path(__file__).resolve().parents[1]  # the repository


def build_distribution(target: str, folder: Path) -> Path:
    """The project's ``'wheel'`` or ``'sdist'``, built into ``folder`` offline with the test extra's hatchling."""
    build = [sys.executable, '-m', 'hatchling', 'build', '--target', target, '--directory', str(folder)]
    proc = subprocess.run(build, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f'$ {" ".join(build)}\n{proc.stdout}{proc.stderr}'
    (built,) = folder.iterdir()
    return built


def install(env: Path, source: Path, editable: bool = False) -> Path:
    """``source`` (a wheel, or the repository for an editable install) installed offline into a new virtual
    environment ``env``, which sees this environment's packages through a ``.pth`` file (whose own ``.pth`` files,
    this environment's install of timm-hbf among them, it does not run)."""
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
    """``env``'s ``bin/ARGS[0]`` run with ``ARGS[1:]`` in ``cwd``, ``extra_env`` added to the environment."""
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


def images(batch: int = 2, size: int = 32, scale: float = 1.) -> torch.Tensor:
    """A fixed batch of random images."""
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(0)) * scale


def layer_normed(*shape: int, seed: int = 1234) -> torch.Tensor:
    """Random tokens after a LayerNorm without affine, as HyperBF layers see them in a pre-norm block."""
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.layer_norm(torch.randn(*shape, generator=g) * 3 + 1, shape[-1:])


def dropout_matches_its_expectation(layer: torch.nn.Module, plain: torch.nn.Module, x: torch.Tensor) -> None:
    """``layer`` with dropout, ``plain`` without, ``x`` one input repeated (a draw each): in training every draw is
    another and their mean ``plain``'s output (within 5 standard errors); in evaluation ``layer`` gives it."""
    torch.manual_seed(0)
    with torch.no_grad():
        expected = plain(x[:1])[0]
        draws = layer.train()(x)
        torch.testing.assert_close(layer.eval()(x[:1])[0], expected)
    assert not torch.allclose(draws[0], draws[1])
    standard_error = draws.std(0) / draws.shape[0] ** .5
    assert ((draws.mean(0) - expected).abs() < 5 * standard_error + 1e-6).all()


def compiled_matches_eager(model: torch.nn.Module, x: torch.Tensor, backend: str) -> None:
    """``torch.compile(model, fullgraph=True)`` gives the eager outputs in eval under ``torch.inference_mode`` (as
    timm's scripts evaluate), and the eager loss and gradients in a training step (the same dropout masks)."""
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


def assert_model_contract(name: str) -> None:
    """timm's contract for a registered model (as timm's tests/test_models.py checks it), with two blocks at most 64
    pixels: logits, every parameter a finite gradient; ``forward_head(forward_features)`` is ``forward``;
    ``forward_intermediates`` gives those features and a map a block (tuple or dict), ``get_intermediate_layers`` their
    tokens; ``features_only`` the maps of its ``feature_info``; ``reset_classifier(0)`` the pooled features; pruning
    keeps the blocks asked for."""
    size = min(64, timm.get_pretrained_cfg_value(name, 'input_size')[-1])
    torch.manual_seed(0)
    model = timm.create_model(name, depth=2, img_size=size)
    x = torch.randn(2, 3, size, size)
    model(x).square().mean().backward()
    assert not [n for n, p in model.named_parameters() if p.grad is None or not p.grad.isfinite().all()]
    model.eval()
    grid = size // model.patch_embed.patch_size[0]
    with torch.no_grad():
        logits, features = model(x), model.forward_features(x)
        assert logits.shape == (2, model.num_classes)
        torch.testing.assert_close(model.forward_head(features), logits)
        assert model.forward_head(features, pre_logits=True).shape == (2, model.num_features)
        final, maps = model.forward_intermediates(x)
        torch.testing.assert_close(final, features)
        assert [m.shape for m in maps] == [(2, model.embed_dim, grid, grid)] * 2
        as_dict = model.forward_intermediates(x, output_dict=True)
        torch.testing.assert_close([as_dict['image_features'], as_dict['image_intermediates']], [final, maps])
        tokens = model.forward_intermediates(x, output_fmt='NLC', intermediates_only=True)
        torch.testing.assert_close(list(model.get_intermediate_layers(x, n=2)), tokens)
        backbone = timm.create_model(name, depth=2, img_size=size, features_only=True, out_indices=(0, 1)).eval()
        assert [f.shape for f in backbone(x)] == [(2, c, grid, grid) for c in backbone.feature_info.channels()]
        model.reset_classifier(0)
        assert model(x).shape == (2, model.num_features)
    assert model.prune_intermediate_layers([0]) == [0] and len(model.blocks) == 1


def assert_every_batch_gives_the_logits_of_its_images(build, half_tolerance: float = 1.) -> None:
    """``build()``'s model gives in eval the logits of the images of every batch timm's ViT takes: empty, one image,
    channels-last, strided; in bf16 or fp16 within ``half_tolerance`` times 2 % or 0.5 % (norm-wise) of float32's.
    An empty, a channels-last and a half-precision batch give every parameter a finite gradient in a training step."""
    def logits(model, x, step=False):
        if step:
            trained = copy.deepcopy(model).train()  # its batch norms' running statistics move
            trained(x).float().sum().backward()
            assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in trained.parameters())
        with torch.no_grad():
            out = model.eval()(x)
        assert out.shape == (x.shape[0], model.num_classes) and out.dtype == x.dtype
        return out

    model, x = build(), torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    strided = torch.randn(3, 3, 32, 64)
    strided[..., ::2] = x
    expected = logits(model, x)
    assert logits(model, x[:0], step=True).shape == (0, model.num_classes)
    for batch, rows, step in ((x[1:2], slice(1, 2), False), (x.to(memory_format=torch.channels_last), slice(3), True),
                              (strided[..., ::2], slice(3), False)):
        torch.testing.assert_close(logits(model, batch, step), expected[rows], rtol=1e-4, atol=1e-5)
    for dtype, tolerance in ((torch.bfloat16, 2e-2), (torch.float16, 5e-3)):
        half = logits(build().to(dtype), x.to(dtype), step=True).double()
        assert (half - expected.double()).norm() < half_tolerance * tolerance * expected.double().norm(), dtype


EXECUTION_MODES = ['compiled_whole', 'compiled_by_region', 'compiled_past_a_graph_break', 'exported']


def run_as(mode: str, model: torch.nn.Module, x: torch.Tensor, backend: str = 'inductor'):
    """``model`` as ``mode`` runs it: compiled whole (``fullgraph=True``), by region (every block on its own), past a
    graph break (a middle block's hook), or exported (``torch.export``, a dynamic batch, the model's parameters)."""
    if mode == 'compiled_whole':
        return torch.compile(model, fullgraph=True, backend=backend)
    if mode == 'compiled_by_region':
        for block in model.blocks:
            block.compile(backend=backend)
        return model
    if mode == 'compiled_past_a_graph_break':
        model.blocks[len(model.blocks) // 2].register_forward_hook(lambda m, a, out: torch._dynamo.graph_break())
        return torch.compile(model, backend=backend)
    return torch.export.export(model, (x[:2],), dynamic_shapes=({0: torch.export.Dim('batch')},)).module()


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
    """A checkpoint of timm_hbf 0.1.0 (``tests/data``): model name and kwargs, state dict, two images and the logits
    that version gave them in eval."""
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
