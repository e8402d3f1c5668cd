"""Throughput and peak memory of our models against timm's ViT (and optionally timm's MLP-Mixer) of the same size,
side by side in one run.

Every model is compared with a timm ``VisionTransformer`` built with the same width, depth, heads, MLP width, qkv
bias, image size, patch size and classes; ``--mixer`` adds a timm ``MlpMixer`` with the same width, depth, channel-MLP
width, patch, image size and classes. Throughput is measured in one process with all models interleaved round by
round (so drifts in machine load hit them alike), and reported as the median over rounds; a throughput ratio is the
median over rounds of the ratio within a round, with its range over rounds. In every round each model's timed steps
follow one untimed step of its own: on the CPU, the first step after another model's steps runs slower (the
allocator's free memory and the caches hold that model's tensors), which would otherwise count against whichever
model follows the most different one in the rotation. Peak memory is measured for
each model in a fresh subprocess, as the memory of a step: on CUDA ``torch.cuda.max_memory_allocated`` over steps
after a first one; on CPU (Linux) the parameters, buffers and optimizer state, plus the peak resident set size of
those steps above the resident size just before them (gradients, activations and temporaries). What the process
itself holds (libraries, and under ``--compiled`` the compiler and its generated code, which can outweigh a small
model's activations) is left out on both. glibc's mmap threshold is pinned at 128 KiB (``MALLOC_MMAP_THRESHOLD_``):
every tensor of that size or more is then mapped on allocation and returned on free, so that the resident size
counts live tensors, as CUDA's count does, and not heap memory that the allocator kept after frees (by default glibc
raises the threshold as the program frees large blocks, and how much freed memory it keeps depends on the order of
allocations).

``--compiled`` also times every model under ``torch.compile``, in the same rounds, and reports it beside eager
(compiled ratios are to the compiled ViT). Every row shows the multiply-accumulates of one image's forward pass
(``torch.utils.flop_counter``) and the candidate's arithmetic ceiling, the ViT's MACs over its own: the throughput
ratio a model would reach if it ran its arithmetic exactly as fast as the ViT runs its own. QIMIA's reads over
depth are element-wise, so the counter leaves them out, and their time is set by the bytes they move rather than by
arithmetic: every row also shows those bytes (what one image's forward pass reads as keys and values, ``reads
MB/img``) and the roofline, the ratio a model would reach running its arithmetic at the ViT's rate and moving its
reads' bytes at the device's copy bandwidth (measured at the start of the run, recorded in the environment). A
forward pass reads every entry once; a training step moves them four times (autograd's backward pass reads every
entry again, and adds its gradient into the entry's, reading and writing it). ``--json PATH`` writes every round and
the environment, the Markdown table (``PATH`` with ``.md``) and a bar chart (``.png``).

    python benchmarks/throughput.py --mixer --compiled                # the README table (CPU)
    python benchmarks/throughput.py --device cuda --amp --compiled     # CUDA, bf16 autocast
"""
import argparse
import ast
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from typing import Optional

import timm
import torch
from torch.utils.flop_counter import FlopCounterMode

import timm_hbf
from timm_hbf.layers import DepthAttention
from timm_hbf.models import VisionTransformerQimia

MMAP_THRESHOLD = 128 * 1024  # bytes; see the module docstring
READ_PASSES = {False: 1, True: 4}  # times an inference pass and a training step move the reads' entries (docstring)

# (candidate, batch size on CPU, batch size on CUDA)
DEFAULT_CASES = [
    ('vit_hyperbf_tiny', 128, 1024),
    ('vit_hyperbf_tiny_patch16_224', 32, 256),
    ('vit_qimia_tiny', 128, 1024),
]
# further variants of a candidate, measured beside it: label -> kwargs of timm.create_model
VARIANTS = {
    'vit_qimia_tiny': {'vit_qimia_tiny, memory_block_size=4': dict(memory_block_size=4)},
}


def dimensions(model: torch.nn.Module) -> dict:
    """What a same-size baseline must share with the candidate (for QIMIA: its token attention and feed-forward)."""
    block = model.blocks[0]
    if isinstance(model, VisionTransformerQimia):
        attn, hidden = block.attn.body, block.mlp.body[0].out_features
    else:
        attn, hidden = block.attn, block.mlp.readout.in_features
    return dict(
        img_size=model.pretrained_cfg['input_size'][-1],
        patch_size=model.patch_embed.patch_size[0],
        embed_dim=model.embed_dim,
        depth=len(model.blocks),
        num_heads=attn.num_heads,
        hidden=hidden,
        qkv_bias=attn.qkv.bias is not None,
        num_classes=model.num_classes,
    )


def vit_args(dims: dict) -> dict:
    """timm's residual ViT with the candidate's width, depth, heads, MLP width, qkv bias, patch, input and classes."""
    return dict(model_name='vit_base_patch16_224', img_size=dims['img_size'], patch_size=dims['patch_size'],
                embed_dim=dims['embed_dim'], depth=dims['depth'], num_heads=dims['num_heads'],
                mlp_ratio=dims['hidden'] / dims['embed_dim'], qkv_bias=dims['qkv_bias'],
                num_classes=dims['num_classes'])


def mixer_args(dims: dict) -> dict:
    """timm's MLP-Mixer with the candidate's width, depth, channel-MLP width, patch, input and classes (token-mixing
    MLP at timm's default half width)."""
    return dict(architecture='MlpMixer', img_size=dims['img_size'], patch_size=dims['patch_size'],
                embed_dim=dims['embed_dim'], num_blocks=dims['depth'],
                mlp_ratio=(0.5, dims['hidden'] / dims['embed_dim']), num_classes=dims['num_classes'])


# label -> kwargs of timm.create_model for a baseline of the candidate's size; ratios are to REFERENCE
REFERENCE, MIXER = 'timm ViT', 'timm MLP-Mixer'
BASELINES = {REFERENCE: vit_args, MIXER: mixer_args}
EXECUTIONS = ('eager', 'compiled')


def executions(args) -> tuple:
    """Eager, and compiled with ``--compiled``."""
    return EXECUTIONS if args.compiled else EXECUTIONS[:1]


class KeywordArguments(argparse.Action):
    """``KEY=VALUE ...`` into a dict, values read as Python literals where they are one (as train.py's
    ``--model-kwargs``)."""

    def __call__(self, parser, namespace, values, option_string=None):
        kwargs = {}
        for item in values:
            key, sep, value = item.partition('=')
            if not sep:
                parser.error(f'{option_string} takes KEY=VALUE pairs, got {item!r}')
            try:
                kwargs[key] = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                kwargs[key] = value
        setattr(namespace, self.dest, kwargs)


def build(spec: dict, device: str) -> torch.nn.Module:
    """A timm model by registered name (``model_name``), or by class of ``timm.models`` (``architecture``) where the
    registered names fix the dimensions (MLP-Mixer)."""
    spec = dict(spec)
    if 'architecture' in spec:
        return getattr(timm.models, spec.pop('architecture'))(**spec).to(device)
    return timm.create_model(**spec).to(device)


def make_step(model: torch.nn.Module, batch: torch.Tensor, train: bool, amp: bool):
    device_type = batch.device.type
    if train:
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        target = torch.randint(0, model.num_classes, (batch.shape[0],), device=batch.device)

        def step():
            with torch.autocast(device_type, dtype=torch.bfloat16, enabled=amp):
                loss = torch.nn.functional.cross_entropy(model(batch), target)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    else:
        model.eval()

        optimizer = None

        @torch.inference_mode()
        def step():
            with torch.autocast(device_type, dtype=torch.bfloat16, enabled=amp):
                model(batch)
    step.optimizer = optimizer  # for the memory measurement: the optimizer's state is held between steps
    return step


def sync(device: str) -> None:
    if device == 'cuda':
        torch.cuda.synchronize()


def throughput(specs: dict, input_size: tuple, batch_size: int, train: bool, args) -> dict:
    """Images/s of each model (keys ``(label, execution)``, execution ``'eager'`` or ``'compiled'``), interleaved
    over rounds; returns the median and all rounds."""
    steps = {}
    for label, spec in specs.items():
        for execution in executions(args):
            model = build(spec, args.device)
            if execution == 'compiled':
                model = torch.compile(model)
            batch = torch.randn(batch_size, *input_size, device=args.device)
            steps[label, execution] = make_step(model, batch, train, args.amp)
            for _ in range(args.warmup):
                steps[label, execution]()
            sync(args.device)
    rounds = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            step()  # untimed: the allocator and caches return to this model's state after another model's steps
            sync(args.device)
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            sync(args.device)
            rounds[name].append(batch_size * args.steps / (time.perf_counter() - start))
    return {name: dict(median=statistics.median(r), rounds=r) for name, r in rounds.items()}


def peak_memory(spec: dict, input_size: tuple, batch_size: int, train: bool, compiled: bool, args) -> float:
    """Peak memory in MiB of a few steps of one model, measured in a fresh process."""
    spec = dict(spec, input_size=list(input_size))
    cmd = [sys.executable, __file__, '--measure-memory', json.dumps(spec), '--batch-size', str(batch_size),
           '--device', args.device] + (['--train'] if train else []) + (['--amp'] if args.amp else []) + \
          (['--compiled'] if compiled else [])
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD))
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return float(out.strip().splitlines()[-1])


def proc_status_kib(field: str) -> int:
    with open('/proc/self/status') as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ':'))


def reset_peak_rss() -> int:
    """Reset the kernel's peak-RSS mark (Linux) and return the current RSS in KiB."""
    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')
    return proc_status_kib('VmRSS')


def held_tensor_mib(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> float:
    """MiB of the tensors a model holds between steps: parameters, buffers and the optimizer's state."""
    tensors = list(model.parameters()) + list(model.buffers())
    if optimizer is not None:
        tensors += [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
    return sum(t.numel() * t.element_size() for t in tensors) / 2 ** 20


def measure_memory_here(spec: dict, batch_size: int, train: bool, args) -> float:
    """Peak memory of a step in MiB: the parameters, buffers and optimizer state, plus the step's peak above what the
    process held just before it (gradients, activations, temporaries), measured over two steps after a first one (which
    compiles a compiled model and creates the optimizer state). On CUDA, what ``max_memory_allocated`` counts."""
    input_size = spec.pop('input_size')
    model = build(spec, args.device)
    batch = torch.randn(batch_size, *input_size, device=args.device)
    step = make_step(torch.compile(model) if args.compiled else model, batch, train, args.amp)
    step()
    sync(args.device)
    if args.device == 'cuda':
        torch.cuda.reset_peak_memory_stats()
    else:
        rss_between_steps = reset_peak_rss()
    for _ in range(2):
        step()
    sync(args.device)
    if args.device == 'cuda':
        return torch.cuda.max_memory_allocated() / 2 ** 20
    step_peak = (proc_status_kib('VmHWM') - rss_between_steps) / 2 ** 10
    return held_tensor_mib(model, step.optimizer) + step_peak


def forward_macs(spec: dict, input_size: tuple) -> int:
    """Multiply-accumulates of one image's forward pass, as torch's FLOP counter counts them (matrix products and
    attention kernels; element-wise ops are not counted)."""
    model = build(spec, 'cpu').eval()
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(torch.randn(1, *input_size))
    return counter.get_total_flops() // 2


def read_traffic(spec: dict, input_size: tuple, amp: bool) -> float:
    """Bytes of keys and values that one image's forward pass reads over depth (QIMIA's reads; 0 for other models),
    in the dtypes the model runs in: every read's entries, counted at batch 2 less batch 1, so that entries shared
    by the batch (position embedding, null entry) count once per batch, not per image."""
    model = build(spec, 'cpu').eval()
    read = []

    def count(module, args):
        read.append(sum(t.numel() * t.element_size() for entries in args for t in entries))

    for module in model.modules():
        if isinstance(module, DepthAttention):
            module.register_forward_pre_hook(count)
    totals = []
    for batch_size in (1, 2):
        read.clear()
        with torch.no_grad(), torch.autocast('cpu', dtype=torch.bfloat16, enabled=amp):
            model(torch.randn(batch_size, *input_size))
        totals.append(sum(read))
    return float(totals[1] - totals[0])


def copy_bandwidth(device: str) -> float:
    """The device's memory bandwidth in bytes/s as copying 256 MiB shows it (bytes read and written), median of 5."""
    source = torch.randn(64 * 2 ** 20, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    seconds = []
    for _ in range(5):
        sync(device)
        start = time.perf_counter()
        target.copy_(source)
        sync(device)
        seconds.append(time.perf_counter() - start)
    return 2 * source.numel() * source.element_size() / statistics.median(seconds)


def roofline(ceiling: float, read_bytes: float, passes: int, reference_images_per_s: float, bandwidth: float) -> float:
    """The throughput ratio to the ViT of a model that runs its arithmetic as fast as the ViT runs its own and moves
    its reads' bytes ``passes`` times at ``bandwidth``: the ViT's time per image over that model's."""
    return 1. / (1. / ceiling + passes * read_bytes * reference_images_per_s / bandwidth)


def paired_ratio(rounds: list, reference_rounds: list) -> dict:
    """Median and range over rounds of each round's ratio to the reference's same round: a drift in machine load
    between rounds cancels in every ratio, which it does not in a ratio of medians."""
    ratios = [a / b for a, b in zip(rounds, reference_rounds)]
    return dict(median=statistics.median(ratios), range=[min(ratios), max(ratios)])


def markdown_table(results: list) -> str:
    """One line per case, mode and model; ratios are to the ViT of the same case, mode and execution; "of ceiling" is
    the throughput ratio over the arithmetic ceiling (the ViT's MACs over the model's), "of roofline" over the
    roofline (the ceiling with the reads' bytes moved at the device's bandwidth)."""
    shown_executions = [e for e in EXECUTIONS if any(e in m for r in results for m in r['models'].values())]
    header = '| model | input/patch | mode | batch | GMACs | ceiling | reads MB/img |'
    rule = '|---|---|---|---|---|---|---|'
    for execution in shown_executions:
        header += f' {execution} img/s | ratio to ViT (range) | of ceiling | roofline | of roofline | peak MiB |' \
                  ' ratio to ViT |'
        rule += '---|---|---|---|---|---|---|'
    lines = [header, rule]
    for r in results:
        for label, m in r['models'].items():
            shown = f"`{label}`" if m['spec'].get('model_name') == r['model'] else label
            line = f"| {shown} | {r['input']} | {r['mode']} | {r['batch_size']} | {m['macs'] / 1e9:.3f} | " \
                   f"{m['ceiling']:.2f} | {m['read_bytes'] / 1e6:.1f} |"
            for execution in shown_executions:
                x = m[execution]
                low, high = x['throughput_ratio_range']
                line += f" {x['images_per_s']:.1f} | {x['throughput_ratio']:.2f} ({low:.2f}-{high:.2f}) | " \
                        f"{x['throughput_ratio'] / m['ceiling']:.2f} | {x['roofline']:.2f} | " \
                        f"{x['throughput_ratio'] / x['roofline']:.2f} | {x['peak_mib']:.0f} | {x['memory_ratio']:.2f} |"
            lines.append(line)
    return '\n'.join(lines)


def plot(results: list, env: dict, path: str) -> None:
    """Bar charts of images/s, one panel per case and mode, every model of the case side by side."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    rows = 2 if len(results) > 1 else 1  # inference above, training below
    cols = math.ceil(len(results) / rows)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.2 * rows), squeeze=False)
    for ax, r in zip(axes.T.flat, results):
        labels = list(r['models'])
        ax.bar(range(len(labels)), [r['models'][k]['eager']['images_per_s'] for k in labels],
               color=['tab:blue' if r['models'][k]['spec'].get('model_name') == r['model'] else 'tab:gray'
                      for k in labels])
        ax.set_xticks(range(len(labels)), [k.replace('timm ', '').replace(', ', '\n').replace('_', '_\n', 1)
                                           for k in labels], fontsize=7)
        ax.set_title(f"{r['input']} {r['mode']}, batch {r['batch_size']}, eager", fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel('images/s')
    for ax in list(axes.T.flat)[len(results):]:
        ax.axis('off')
    fig.suptitle(f"{env['device']}, {env['threads']} threads, torch {env['torch']}{', bf16' if env['amp'] else ''}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cpu_name() -> str:
    """The CPU's model name (Linux) or architecture, with the vector instructions torch's CPU kernels use."""
    name = platform.processor() or platform.machine()
    if os.path.exists('/proc/cpuinfo'):
        with open('/proc/cpuinfo') as f:
            name = next((line.split(':', 1)[1].strip() for line in f if line.startswith('model name')), name)
    return f'{name}, {torch.backends.cpu.get_cpu_capability()}'


def environment(args) -> dict:
    """Where and how a benchmark ran: date, device, threads, versions, its command line and settings."""
    return dict(
        date=datetime.now(timezone.utc).isoformat(timespec='seconds'),
        device=torch.cuda.get_device_name() if args.device == 'cuda' else cpu_name(),
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        timm=timm.__version__,
        timm_hbf=timm_hbf.__version__,
        python=platform.python_version(),
        command=' '.join([sys.executable.rsplit('/', 1)[-1]] + sys.argv),
        amp=args.amp,
        compiled=args.compiled,
        malloc_mmap_threshold=MMAP_THRESHOLD,
    )


def write_results(path: str, env: dict, results: list, text: str) -> None:
    """``path``: the environment and the results as JSON; beside it (``.md``) the command and ``text``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, 'w') as f:
        json.dump(dict(environment=env, results=results), f, indent=2)
    with open(os.path.splitext(path)[0] + '.md', 'w') as f:
        f.write(f"`{env['command']}`\n\n{text}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--models', nargs='+', help='candidate model names (default: the README cases)')
    parser.add_argument('--model-kwargs', nargs='*', default={}, action=KeywordArguments, metavar='KEY=VALUE',
                        help="keyword arguments for every candidate (e.g. depth=2); baselines follow its dimensions")
    parser.add_argument('--batch-size', type=int, help='batch size for every case (default: per case)')
    parser.add_argument('--device', default='cpu')
    parser.add_argument('--amp', action='store_true', help='bf16 autocast')
    parser.add_argument('--compiled', action='store_true',
                        help='also time every model under torch.compile, reported beside eager')
    parser.add_argument('--mixer', action='store_true', help="add timm's MLP-Mixer of the same size to every case")
    parser.add_argument('--threads', type=int, help='torch CPU threads (default: torch default)')
    parser.add_argument('--warmup', type=int, default=3)
    parser.add_argument('--steps', type=int, default=3, help='steps per round')
    parser.add_argument('--rounds', type=int, default=7)
    parser.add_argument('--json', help='write the results to this JSON file')
    parser.add_argument('--measure-memory', help=argparse.SUPPRESS)
    parser.add_argument('--train', action='store_true', help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    if args.measure_memory:
        print(measure_memory_here(json.loads(args.measure_memory), args.batch_size, args.train, args))
        return

    env = environment(args)
    env['copy_bandwidth_gbs'] = copy_bandwidth(args.device) / 1e9
    baselines = [REFERENCE] + ([MIXER] if args.mixer else [])
    cases = [(m, args.batch_size, args.batch_size) for m in args.models] if args.models else DEFAULT_CASES
    results = []
    for name, cpu_bs, cuda_bs in cases:
        batch_size = (cuda_bs if args.device == 'cuda' else cpu_bs) or (256 if args.device == 'cuda' else 32)
        meta_model = timm.create_model(name, device='meta', **args.model_kwargs)
        input_size = tuple(meta_model.pretrained_cfg['input_size'])
        dims = dimensions(meta_model)
        specs = {name: dict(args.model_kwargs, model_name=name),
                 **{label: dict(args.model_kwargs, **kwargs, model_name=name)
                    for label, kwargs in VARIANTS.get(name, {}).items()},
                 **{label: BASELINES[label](dims) for label in baselines}}
        macs = {label: forward_macs(spec, input_size) for label, spec in specs.items()}
        read_bytes = {label: read_traffic(spec, input_size, args.amp) for label, spec in specs.items()}
        for train in (False, True):
            speed = throughput(specs, input_size, batch_size, train, args)
            row = dict(model=name, input=f"{dims['img_size']}/{dims['patch_size']}", mode='train' if train else 'infer',
                       batch_size=batch_size, models={})
            for label, spec in specs.items():
                ceiling = macs[REFERENCE] / macs[label]
                row['models'][label] = dict(spec=spec, macs=macs[label], ceiling=ceiling, read_bytes=read_bytes[label])
                for execution in executions(args):
                    ratio = paired_ratio(speed[label, execution]['rounds'], speed[REFERENCE, execution]['rounds'])
                    row['models'][label][execution] = dict(
                        images_per_s=speed[label, execution]['median'], rounds=speed[label, execution]['rounds'],
                        throughput_ratio=ratio['median'], throughput_ratio_range=ratio['range'],
                        roofline=roofline(ceiling, read_bytes[label], READ_PASSES[train],
                                          speed[REFERENCE, execution]['median'], env['copy_bandwidth_gbs'] * 1e9),
                        peak_mib=peak_memory(spec, input_size, batch_size, train, execution == 'compiled', args),
                    )
            for execution in executions(args):
                reference = row['models'][REFERENCE][execution]['peak_mib']
                for entry in row['models'].values():
                    entry[execution]['memory_ratio'] = entry[execution]['peak_mib'] / reference
            results.append(row)
            print(f"{name} {row['mode']}: " + ', '.join(
                f"{label} {execution} {e[execution]['images_per_s']:.1f} img/s ({e[execution]['throughput_ratio']:.3f}x"
                f", {e[execution]['throughput_ratio'] / e['ceiling']:.3f} of ceiling, "
                f"{e[execution]['throughput_ratio'] / e[execution]['roofline']:.3f} of roofline), "
                f"{e[execution]['peak_mib']:.0f} "
                f"MiB ({e[execution]['memory_ratio']:.3f}x)"
                for label, e in row['models'].items() for execution in executions(args)), flush=True)

    title = f"{env['device']}, {env['threads']} threads, copy bandwidth {env['copy_bandwidth_gbs']:.1f} GB/s, " \
            f"torch {env['torch']}, timm {env['timm']}, {env['date']}{', bf16 autocast' if args.amp else ''}"
    table = markdown_table(results)
    print(f'\n{title}\n\n{table}')
    if args.json:
        write_results(args.json, env, results, f'{title}\n\n{table}')
        plot(results, env, os.path.splitext(args.json)[0] + '.png')


if __name__ == '__main__':
    main()
