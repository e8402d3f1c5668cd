"""Speed and peak memory of our models beside timm's ViT (and MLP-Mixer) of the same size, measured in one run.

Every candidate model is compared with a timm ``VisionTransformer`` of its width, depth, heads, MLP width, qkv bias,
image size, patch size and classes; ``--mixer`` adds a timm ``MlpMixer`` of its width, depth, channel-MLP width, patch,
image size and classes; candidates of one shape share them, timed in the same rounds. ``--attention TOKENS...``
compares the layers instead: ``HyperBFAttention`` against timm's ``Attention`` (which runs
``F.scaled_dot_product_attention``) of the same width and heads, on that many tokens.
``--variants`` adds the candidate built with other arguments (``memory_block_size=4``) beside it; ``--model-kwargs``
changes the candidate and its baselines together (``depth=24``: a depth sweep, one run per depth).

Speed: inference (a forward pass under ``inference_mode``) and training (an AdamW step on the cross-entropy, or for a
layer on the mean square of its output) in images (sequences) per second. All models run in one process, interleaved
round by round, so that a change in the machine's load hits them alike; each model's timed steps follow one untimed
step of its own (after another model's steps the caches and the allocator hold that model's tensors). A ratio is the
median over rounds of the ratio to the baseline in the same round, with its range over rounds. ``--compiled`` also
times every model under ``torch.compile``, in the same rounds, with ratios to the compiled baseline. On CUDA, float32
matrix products run as TF32, as timm's train.py sets them (HyperBF's distances are float32 also under bf16 autocast).

Peak memory of a step, each model in a fresh process (several side by side, after the timing): on CUDA
``torch.cuda.max_memory_allocated``; on the CPU (Linux) the parameters, buffers and optimizer state plus the peak
resident size of two steps above the resident size before them, with glibc's mmap threshold pinned at 128 KiB so that
freed tensors go back to the system at once and the resident size counts live tensors as CUDA's count does. What the
process holds besides (libraries, the compiler) is left out on both. The same processes time their first step: for
a compiled model, the wait for compiling before the first step (as train.py's ``--torchcompile`` starts). With
``--cold-compile`` each process starts with empty compiler caches, as a first run does; without it, the caches hold
what the timing compiled, as a rerun finds them.

Arithmetic and launches: GMACs of one image's forward pass (torch's FLOP counter) and the ceiling, the baseline's
MACs over the model's; ops/step, the aten operators one training step (forward and backward) dispatches, each a
cost on the host in eager mode; and kernels/step, those of them that launch a kernel (not views, allocations or
metadata), the CPU's count of what a GPU launches in eager mode, where a small model's step is bound by launches.
``--json PATH`` writes the environment (device, versions, command, date) and every round, with the Markdown table
beside it (``.md``).

    python benchmarks/throughput.py --compiled --batch-size 64                      # every tiny model, the CPU table
    python benchmarks/throughput.py --models vit_qimia_tiny --variants memory_block_size=4 memory_block_size=5
    python benchmarks/throughput.py --device cuda --amp --compiled --mixer --models vit_hyperbf_tiny vit_qimia_tiny \\
        --batch-size 1024 --json speed.json
    python benchmarks/throughput.py --device cuda --amp --compiled --attention 256 512 1024 2048 4096
"""
import argparse
import ast
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Callable, Dict, List, Optional, Tuple

import timm
import torch
import torch.nn.functional as F
from timm.layers import Mlp
from timm.utils import ParseKwargs
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import timm_hbf
from timm_hbf.models import PretrainedWeightsError, VisionTransformerQimia

MMAP_THRESHOLD = 128 * 1024  # bytes: see the module docstring
BASELINE, MIXER = 'timm ViT', 'timm MLP-Mixer'
LAYER, LAYER_BASELINE = 'HyperBFAttention', 'timm Attention (SDPA)'
DEFAULT_MODELS = ['vit_hyperbf_tiny', 'vit_hyperbf_nrbf_tiny', 'vit_qimia_tiny', 'vit_attnres_tiny',
                  'vit_attnres_block_tiny']
DEFAULT_BATCH = (64, 1024)  # CPU, CUDA


def mlp_hidden(mlp: torch.nn.Module) -> int:
    """The hidden width of a feed-forward block: timm's ``Mlp``, QIMIA's (its first Linear) or HyperBF's."""
    return mlp.fc1.out_features if isinstance(mlp, Mlp) else mlp[0].out_features if isinstance(
        mlp, torch.nn.Sequential) else mlp.readout.in_features


def dimensions(model: torch.nn.Module) -> dict:
    """What a same-size baseline shares with the candidate (for QIMIA: its token attention and feed-forward)."""
    block = model.blocks[0]
    qimia = isinstance(model, VisionTransformerQimia) and not model.sublayer_values
    attn = block.attn.body if qimia else block.attn
    height, width = model.patch_embed.img_size  # as built: --model-kwargs img_size=... included
    return dict(img_size=height if height == width else (height, width), patch_size=model.patch_embed.patch_size[0],
                embed_dim=model.embed_dim, depth=len(model.blocks), num_heads=attn.num_heads,
                hidden=mlp_hidden(block.mlp.body if qimia else block.mlp),
                qkv_bias=attn.qkv.bias is not None, num_classes=model.num_classes,
                in_chans=model.patch_embed.proj.in_channels)


def baselines(dims: dict, mixer: bool) -> Dict[str, dict]:
    """timm's residual ViT (and MLP-Mixer, token-mixing MLP at timm's default half width) of the candidate's size."""
    specs = {BASELINE: dict(model_name='vit_base_patch16_224', img_size=dims['img_size'],
                            patch_size=dims['patch_size'], embed_dim=dims['embed_dim'], depth=dims['depth'],
                            num_heads=dims['num_heads'], mlp_ratio=dims['hidden'] / dims['embed_dim'],
                            qkv_bias=dims['qkv_bias'], num_classes=dims['num_classes'], in_chans=dims['in_chans'])}
    if mixer:
        specs[MIXER] = dict(cls='timm.models.mlp_mixer.MlpMixer', img_size=dims['img_size'],
                            patch_size=dims['patch_size'], embed_dim=dims['embed_dim'], num_blocks=dims['depth'],
                            mlp_ratio=(0.5, dims['hidden'] / dims['embed_dim']), num_classes=dims['num_classes'],
                            in_chans=dims['in_chans'])
    return specs


def build(spec: dict, device: str) -> torch.nn.Module:
    """A timm model by registered name (``model_name``), or any module by class path (``cls``) where the registered
    names fix what is compared (MLP-Mixer's dimensions, attention layers)."""
    spec = {k: v for k, v in spec.items() if k != 'input_size'}
    if 'cls' in spec:
        module, name = spec.pop('cls').rsplit('.', 1)
        return getattr(importlib.import_module(module), name)(**spec).to(device)
    return timm.create_model(**spec).to(device)


def make_step(model: torch.nn.Module, batch: torch.Tensor, train: bool, amp: bool) -> Callable[[], None]:
    """One inference pass, or one AdamW training step; ``step.optimizer`` holds the optimizer (for its state)."""
    autocast = torch.autocast(batch.device.type, dtype=torch.bfloat16, enabled=amp)
    model.train(train)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4) if train else None
    classes = getattr(model, 'num_classes', None)
    target = torch.randint(0, classes or 1, batch.shape[:1], device=batch.device)

    def step() -> None:
        if not train:
            with torch.inference_mode(), autocast:
                model(batch)
            return
        with autocast:
            out = model(batch)
            loss = F.cross_entropy(out, target) if classes else out.float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    step.optimizer = optimizer
    return step


def sync(device: str) -> None:
    if device.startswith('cuda'):
        torch.cuda.synchronize()


def compiled(model: torch.nn.Module, backend: Optional[str], by_region: bool = False) -> torch.nn.Module:
    """``model`` under ``torch.compile`` (with ``by_region``, each of its blocks on its own: regional compilation)."""
    if not backend:
        return model
    if by_region:
        for block in model.blocks:
            block.compile(backend=backend)
        return model
    return torch.compile(model, backend=backend)


def throughput(specs: Dict[str, dict], batch_size: int, train: bool, args) -> Dict[Tuple[str, str], List[float]]:
    """Images/s of every model and execution (``'eager'``, ``'compiled'``) in every round, interleaved."""
    steps = {}
    for label, spec in specs.items():
        for execution, backend in executions(args):
            batch = torch.randn(batch_size, *spec['input_size'], device=args.device)
            model = compiled(build(spec, args.device), backend, execution == 'by_region')
            steps[label, execution] = make_step(model, batch, train, args.amp)
            for _ in range(args.warmup):
                steps[label, execution]()
    rounds = {key: [] for key in steps}
    for _ in range(args.rounds):
        for key, step in steps.items():
            step()  # untimed: the caches and the allocator come back to this model after another model's steps
            sync(args.device)
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            sync(args.device)
            rounds[key].append(batch_size * args.steps / (time.perf_counter() - start))
    if args.profile:
        for (label, execution), step in steps.items():
            print(f"{label}, {execution}, {'train' if train else 'infer'}: the operators and kernels that take the "
                  f"most time in {args.steps} steps\n{profile_table(step, args)}", flush=True)
    return rounds


def profile_table(step: Callable[[], None], args) -> str:
    """torch.profiler's table of ``args.steps`` steps, sorted by the time spent in each operator or kernel itself
    (on the GPU where there is one): which kernel a slow model spends its time in, and which SDPA kernel runs."""
    cuda = args.device.startswith('cuda')
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(args.steps):
            step()
        sync(args.device)
    return profiler.key_averages().table(sort_by='self_device_time_total' if cuda else 'self_cpu_time_total',
                                         row_limit=12, max_name_column_width=80)


def executions(args) -> List[Tuple[str, Optional[str]]]:
    """(name, torch.compile backend): eager, compiled with ``--compiled``, and by region with ``--by-region``."""
    return [('eager', None)] + ([('compiled', args.compiled)] if args.compiled else []) + \
        ([('by_region', args.compiled or 'inductor')] if args.by_region else [])


def fresh_process_step(spec: dict, batch_size: int, train: bool, backend: Optional[str], args,
                       by_region: bool = False) -> Tuple[float, float]:
    """Peak memory of a step in MiB and the first step's seconds, measured in a fresh process (see the module
    docstring)."""
    cmd = [sys.executable, __file__, '--measure-memory', json.dumps(spec), '--batch-size', str(batch_size),
           '--device', args.device, *(['--train'] if train else []), *(['--amp'] if args.amp else []),
           *(['--compiled', backend] if backend else []), *(['--by-region'] if by_region else [])]
    with tempfile.TemporaryDirectory(prefix='inductor_cache_') as empty:
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD))
        if args.cold_compile:
            env.update(TORCHINDUCTOR_CACHE_DIR=empty, TRITON_CACHE_DIR=os.path.join(empty, 'triton'))
        peak, first_step = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout.split()[-2:]
    return float(peak), float(first_step)


def proc_status_kib(field: str) -> int:
    with open('/proc/self/status') as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ':'))


def measure_memory_here(spec: dict, batch_size: int, train: bool, args) -> Tuple[float, float]:
    """Peak memory of two steps after a first one (which compiles and creates the optimizer state), and the first
    step's seconds. Memory: on CUDA what ``max_memory_allocated`` counts; on the CPU the tensors the model and
    optimizer hold between steps, plus the peak resident size of the steps above the resident size before them
    (gradients, activations, temporaries)."""
    model = build(spec, args.device)
    batch = torch.randn(batch_size, *spec['input_size'], device=args.device)
    step = make_step(compiled(model, args.compiled, args.by_region), batch, train, args.amp)
    sync(args.device)
    start = time.perf_counter()
    step()
    sync(args.device)
    first_step = time.perf_counter() - start
    if args.device.startswith('cuda'):
        torch.cuda.reset_peak_memory_stats()
    else:
        with open('/proc/self/clear_refs', 'w') as f:
            f.write('5')  # resets the kernel's peak-RSS mark
        before = proc_status_kib('VmRSS')
    for _ in range(2):
        step()
    sync(args.device)
    if args.device.startswith('cuda'):
        return torch.cuda.max_memory_allocated() / 2 ** 20, first_step
    held = list(model.parameters()) + list(model.buffers())
    if step.optimizer is not None:
        held += [t for state in step.optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
    held_mib = sum(t.numel() * t.element_size() for t in held) / 2 ** 20
    return held_mib + (proc_status_kib('VmHWM') - before) / 2 ** 10, first_step


def forward_macs(spec: dict) -> int:
    """Multiply-accumulates of one image's forward pass, as torch's FLOP counter counts them."""
    model = build(spec, 'cpu').eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.randn(1, *spec['input_size']))
    return counter.get_total_flops() // 2


# operators that launch no kernel: views, allocations and metadata
NO_KERNEL = ('set_', 'empty', 'new_empty', 'empty_strided', 'new_empty_strided', 'empty_like', '_unsafe_view',
             'lift_fresh', 'promote_types')


class _OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        self.kernels += not (func.is_view or func.overloadpacket.__name__ in NO_KERNEL)
        return func(*args, **(kwargs or {}))


def operators_per_step(spec: dict) -> Tuple[int, int]:
    """aten operators dispatched by one eager training step's forward and backward pass (at batch 2: the count does
    not depend on the batch), after a first step, and those of them that launch a kernel."""
    model = build(spec, 'cpu').train()
    batch = torch.randn(2, *spec['input_size'])
    for counting in (False, True):
        with _OpCount() if counting else torch.enable_grad() as counter:
            out = model(batch)
            loss = F.cross_entropy(out, torch.zeros(2, dtype=torch.long)) if model.num_classes else out.mean()
            loss.backward()
    return counter.count, counter.kernels


def cases(args) -> List[Tuple[str, int, Dict[str, dict]]]:
    """(case, batch size, label -> spec): the candidates of one shape with their variants and the baselines they share,
    or each attention length."""
    cuda = args.device.startswith('cuda')
    if args.attention:
        layer = dict(dim=args.attention_dim, num_heads=args.attention_dim // 64, qkv_bias=True)
        return [(f'{tokens} tokens', args.batch_size or max(1, 65536 // tokens),
                 {LAYER: dict(layer, cls='timm_hbf.layers.HyperBFAttention', input_size=[tokens, layer['dim']]),
                  LAYER_BASELINE: dict(layer, cls='timm.layers.Attention', input_size=[tokens, layer['dim']])})
                for tokens in args.attention]
    grouped = {}  # (case, baselines) -> (case, the candidates of that shape, the baselines they share)
    model_kwargs = ' '.join(f'{k}={v}' for k, v in args.model_kwargs.items())
    for name in args.models:
        meta = meta_model(name, args.model_kwargs, '--model-kwargs', model_kwargs)
        for variant, kwargs in args.variants.items():
            meta_model(name, dict(args.model_kwargs, **kwargs), '--variants', variant)
        dims = dimensions(meta)
        input_size = [dims['in_chans'], *meta.patch_embed.img_size]  # as built, not as its cfg
        specs = {name: dict(args.model_kwargs, model_name=name)}
        specs.update({f'{name}, {variant}': dict(args.model_kwargs, **kwargs, model_name=name)
                      for variant, kwargs in args.variants.items()})
        bases = {label: dict(spec, input_size=input_size) for label, spec in baselines(dims, args.mixer).items()}
        case = f'{input_size[-1]}/{meta.patch_embed.patch_size[0]}'
        candidates = grouped.setdefault(repr((case, bases)), (case, {}, bases))[1]
        candidates.update({label: dict(spec, input_size=input_size) for label, spec in specs.items()})
    batch_size = args.batch_size or DEFAULT_BATCH[cuda]
    return [(case, batch_size, {**candidates, **bases}) for case, candidates, bases in grouped.values()]


def meta_model(name: str, kwargs: dict, option: str, given: str) -> torch.nn.Module:
    """The model built on the meta device (no memory, no time), so that a name, tag or argument it does not take
    exits naming the argument (``option given``) before anything is measured."""
    try:
        return timm.create_model(name, device='meta', **kwargs)
    except PretrainedWeightsError as e:  # a tag it does not have
        raise SystemExit(f'--models {name}: {e}') from e
    except (TypeError, ValueError) as e:  # an argument it does not take, or a value it refuses
        raise SystemExit(f'{option} {given}: {name} does not take it ({e})') from e


def fresh_process_steps(
        specs: Dict[str, dict], batch_size: int, args) -> Dict[Tuple[str, bool, str], Tuple[float, float]]:
    """Peak memory and first step of every model, mode and execution, in fresh processes run side by side (half the
    CPU cores at a time: compiling takes the cores, and each process measures only its own memory)."""
    jobs = [(label, mode == 'train', execution, backend) for label in specs for mode in args.modes
            for execution, backend in executions(args)]
    with ThreadPoolExecutor(max(1, min(len(jobs), (os.cpu_count() or 2) // 2))) as pool:
        measured = pool.map(lambda job: fresh_process_step(specs[job[0]], batch_size, job[1], job[3], args,
                                                           job[2] == 'by_region'), jobs)
        return {job[:3]: result for job, result in zip(jobs, measured)}


def measure(case: str, batch_size: int, specs: Dict[str, dict], args) -> List[dict]:
    """One row per mode (inference, training) with every model's speed, memory, ratios, ceiling and operators."""
    reference = next(label for label in specs if label in (BASELINE, LAYER_BASELINE))
    macs = {label: forward_macs(spec) for label, spec in specs.items()}
    counted = {label: operators_per_step(spec) for label, spec in specs.items()} if not args.attention else {}
    ops, kernels = ({label: c[i] for label, c in counted.items()} for i in (0, 1))
    rounds = {}
    for mode in args.modes:  # the speeds first, printed as they come; the memory after, in parallel processes
        rounds[mode] = throughput(specs, batch_size, mode == 'train', args)
        print(f"{case} {mode} images/s: " + ', '.join(
            f'{label} {execution} {statistics.median(r):.1f}' for (label, execution), r in rounds[mode].items()),
            flush=True)
    fresh = fresh_process_steps(specs, batch_size, args)
    rows = []
    for mode in args.modes:
        train = mode == 'train'
        row = dict(case=case, mode=mode, batch_size=batch_size, models={})
        for label, spec in specs.items():
            ceiling = macs[reference] / macs[label]
            entry = row['models'][label] = dict(spec=spec, macs=macs[label], ceiling=ceiling,
                                                ops_per_step=ops.get(label), ops_ratio=ops[label] / ops[reference]
                                                if ops else None, kernels_per_step=kernels.get(label),
                                                kernels_ratio=kernels[label] / kernels[reference] if kernels else None)
            for execution, _ in executions(args):
                mine, theirs = rounds[mode][label, execution], rounds[mode][reference, execution]
                ratios = [a / b for a, b in zip(mine, theirs)]
                (peak, first_step), (reference_peak, reference_first) = (
                    fresh[label, train, execution], fresh[reference, train, execution])
                entry[execution] = dict(
                    images_per_s=statistics.median(mine), rounds=mine, throughput_ratio=statistics.median(ratios),
                    throughput_ratio_range=[min(ratios), max(ratios)], peak_mib=peak,
                    memory_ratio=peak / reference_peak, first_step_s=first_step,
                    first_step_ratio=first_step / reference_first)
        rows.append(row)
        print(f"{case} {row['mode']}: " + ', '.join(
            f"{label} {execution} {e[execution]['images_per_s']:.1f}/s ({e[execution]['throughput_ratio']:.2f}x), "
            f"{e[execution]['peak_mib']:.0f} MiB ({e[execution]['memory_ratio']:.2f}x), "
            f"first step {e[execution]['first_step_s']:.1f} s ({e[execution]['first_step_ratio']:.2f}x)"
            for label, e in row['models'].items() for execution, _ in executions(args)), flush=True)
    return rows


def markdown_table(rows: List[dict], args) -> str:
    """One line per case, mode and model; ratios to the baseline of the same case, mode and execution."""
    header = '| model | input | mode | batch | GMACs | ops/step | ratio | kernels/step | ratio |'
    for execution, _ in executions(args):
        header += f' {execution} /s | ratio (range) | peak MiB | memory ratio | first step s | ratio |'
    lines = [header, '|' + '---|' * (header.count('|') - 1)]
    for row in rows:
        for label, m in row['models'].items():
            ops = f"{m['ops_per_step']} | {m['ops_ratio']:.2f} | {m['kernels_per_step']} | {m['kernels_ratio']:.2f}" \
                if m['ops_per_step'] else '- | - | - | -'
            line = f"| {label} | {row['case']} | {row['mode']} | {row['batch_size']} | {m['macs'] / 1e9:.3f} | {ops} |"
            for execution, _ in executions(args):
                x = m[execution]
                low, high = x['throughput_ratio_range']
                line += f" {x['images_per_s']:.1f} | {x['throughput_ratio']:.2f} ({low:.2f}-{high:.2f}) | " \
                        f"{x['peak_mib']:.0f} | {x['memory_ratio']:.2f} | {x['first_step_s']:.1f} | " \
                        f"{x['first_step_ratio']:.2f} |"
            lines.append(line)
    return '\n'.join(lines)


def device_name(device: str) -> str:
    """The GPU's name, or the CPU's model name (Linux) with the vector instructions torch's kernels use."""
    if device.startswith('cuda'):
        return torch.cuda.get_device_name()
    name = platform.processor() or platform.machine()
    if os.path.exists('/proc/cpuinfo'):
        with open('/proc/cpuinfo') as f:
            name = next((line.split(':', 1)[1].strip() for line in f if line.startswith('model name')), name)
    return f'{name}, {torch.backends.cpu.get_cpu_capability()}'


def environment(args) -> dict:
    return dict(date=datetime.now(timezone.utc).isoformat(timespec='seconds'), device=device_name(args.device),
                threads=torch.get_num_threads(), torch=torch.__version__, cuda=torch.version.cuda,
                timm=timm.__version__, timm_hbf=timm_hbf.__version__, python=platform.python_version(),
                command=' '.join(['python', 'benchmarks/throughput.py', *args.argv]), amp=args.amp,
                compiled=args.compiled, cold_compile=args.cold_compile, malloc_mmap_threshold=MMAP_THRESHOLD)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--models', nargs='+', default=DEFAULT_MODELS, help='candidates (default: %(default)s)')
    parser.add_argument('--model-kwargs', nargs='*', default={}, action=ParseKwargs, metavar='KEY=VALUE',
                        help='arguments of every candidate (e.g. depth=2); the baselines follow its dimensions')
    parser.add_argument('--variants', nargs='*', default=[], metavar='KEY=VALUE[,KEY=VALUE]',
                        help='the candidate with these arguments too, measured beside it')
    parser.add_argument('--mixer', action='store_true', help="add timm's MLP-Mixer of the same size")
    parser.add_argument('--attention', nargs='+', type=int, metavar='TOKENS',
                        help="compare HyperBFAttention with timm's Attention on sequences of these lengths instead")
    parser.add_argument('--attention-dim', type=int, default=384, help='width of the layers, 64 per head')
    parser.add_argument('--batch-size', type=int, help='for every case (default: per model; 65536 tokens a batch)')
    parser.add_argument('--device', default='cpu')
    parser.add_argument('--amp', action='store_true', help='bf16 autocast')
    parser.add_argument('--compiled', nargs='?', const='inductor', metavar='BACKEND',
                        help='also time every model under torch.compile (default backend: inductor)')
    parser.add_argument('--by-region', action='store_true',
                        help="also time every model with each block compiled on its own (PyTorch's regional "
                             'compilation; the --compiled backend, default inductor)')
    parser.add_argument('--cold-compile', action='store_true',
                        help='time the first steps with empty compiler caches, as a first run (default: as the '
                             'timing left them, as a rerun)')
    parser.add_argument('--threads', type=int, help='torch CPU threads (default: torch default)')
    parser.add_argument('--modes', nargs='+', choices=['infer', 'train'], default=['infer', 'train'],
                        help='what to measure (default: both); inference alone skips compiling the training steps')
    parser.add_argument('--warmup', type=int, default=3)
    parser.add_argument('--steps', type=int, default=3, help='steps per round')
    parser.add_argument('--rounds', type=int, default=7)
    parser.add_argument('--json', help='write the results to this JSON file (and the table beside it, .md)')
    parser.add_argument('--profile', action='store_true',
                        help="print torch.profiler's table of every model's steps after the rounds")
    parser.add_argument('--measure-memory', help=argparse.SUPPRESS)
    parser.add_argument('--train', action='store_true', help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    unknown = [name for name in args.models if not timm.is_model(name)]
    if unknown and not args.attention:
        parser.error(f"--models {unknown[0]}: timm knows no such model (see timm.list_models(module=['vit_hyperbf', "
                     "'vit_qimia', 'vit_attnres']) for ours)")
    if any(not kv.partition('=')[0] or '=' not in kv for variant in args.variants for kv in variant.split(',')):
        parser.error(f'--variants takes KEY=VALUE[,KEY=VALUE] items, got {" ".join(args.variants)}')
    if args.json:
        check_json(parser, args.json)
    check_counts(parser, args, batch_size=1, attention_dim=1, threads=1, warmup=0, steps=1, rounds=1)
    check_device(parser, args.device)
    args.variants = {variant: {k: literal(v) for k, v in (kv.split('=', 1) for kv in variant.split(','))}
                     for variant in args.variants}
    return args


def check_counts(parser: argparse.ArgumentParser, args: argparse.Namespace, **lowest: int) -> None:
    """``parser.error`` for the first integer argument ``lowest`` names (by dest) that is below its lowest value
    (None, an argument left out, passes)."""
    for dest, low in lowest.items():
        value = getattr(args, dest)
        if value is not None and value < low:
            parser.error(f"--{dest.replace('_', '-')} must be an integer >= {low}, got {value}")


def check_device(parser: argparse.ArgumentParser, device: str) -> None:
    """``parser.error`` unless torch knows ``--device`` and, for CUDA, sees a GPU."""
    try:
        kind = torch.device(device).type
    except RuntimeError as e:
        parser.error(f'--device {device}: not a device torch knows ({e})')
    if kind == 'cuda' and not torch.cuda.is_available():
        parser.error(f'--device {device}: torch sees no CUDA device here (measure on the CPU with --device cpu)')


def check_json(parser: argparse.ArgumentParser, path: str) -> None:
    """``parser.error`` unless ``--json`` and the table beside it (``.md``) can be written: checked before the first
    case is measured, which would otherwise be lost."""
    table = os.path.splitext(path)[0] + '.md'
    if table == path:
        parser.error(f'--json {path}: the table goes beside it as {table}, and would overwrite it: name a .json file')
    for written in (path, table):
        if os.path.isdir(written):
            parser.error(f'--json {path}: {written} is a folder: name a file')
    existing = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        parser.error(f'--json {path}: {existing} is a file, not a folder')
    if not os.access(existing, os.W_OK | os.X_OK):
        parser.error(f'--json {path}: {existing} is not writable')


def literal(value: str):
    """A Python literal where ``value`` is one, else the string (as train.py reads ``--model-kwargs``)."""
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return value


def main(argv: Optional[List[str]] = None) -> List[dict]:
    args = parse_args(argv)
    if args.device.startswith('cuda'):  # as timm's train.py sets them: float32 matrix products run as TF32
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.measure_memory:
        print(*measure_memory_here(json.loads(args.measure_memory), args.batch_size, args.train, args))
        return []
    found = cases(args)  # every model built (on the meta device) before any is measured
    env = environment(args)
    title = f"{env['device']}, {env['threads']} threads, " \
            f"torch {env['torch']}, timm {env['timm']}, {env['date']}{', bf16 autocast' if args.amp else ''}"
    rows = []
    for case in found:  # the files are rewritten after every case: a run stopped early keeps what it measured
        rows += measure(*case, args)
        if args.json:
            write_results(args.json, env, title, rows, args)
    print(f'\n{title}\n\n{markdown_table(rows, args)}')
    return rows


def write_results(path: str, env: dict, title: str, rows: List[dict], args) -> None:
    """The environment and every round as JSON at ``path``, the table beside it (``.md``)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, 'w') as f:
        json.dump(dict(environment=env, results=rows), f, indent=2)
    with open(os.path.splitext(path)[0] + '.md', 'w') as f:
        f.write(f"`{env['command']}`\n\n{title}\n\n{markdown_table(rows, args)}\n")


if __name__ == '__main__':
    main()
