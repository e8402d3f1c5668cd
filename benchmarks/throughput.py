"""Throughput and peak memory of our models against timm's ViT of identical dimensions, side by side in one run.

Every model is compared with a timm ``VisionTransformer`` built with the same width, depth, heads, MLP ratio, qkv
bias, image size, patch size and classes. Throughput is measured in one process with the candidate and the baseline
interleaved round by round (so drifts in machine load hit both), and reported as the median over rounds. Peak memory
is measured for each model in a fresh subprocess: on CUDA ``torch.cuda.max_memory_allocated``, on CPU (Linux) the
peak resident set size minus the resident size just before the model was built (parameters, gradients, optimizer
state and activations).

    python benchmarks/throughput.py                                   # the README table (CPU)
    python benchmarks/throughput.py --device cuda --amp --compile     # CUDA, bf16 autocast, torch.compile
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone

import timm
import torch

import timm_hbf
from timm_hbf.models import VisionTransformerQimia

# (candidate, batch size on CPU, batch size on CUDA)
DEFAULT_CASES = [
    ('vit_hyperbf_tiny', 128, 1024),
    ('vit_hyperbf_tiny_patch16_224', 32, 256),
    ('vit_qimia_tiny', 128, 1024),
]


def baseline_args(model: torch.nn.Module) -> dict:
    """timm ViT kwargs with the candidate's dimensions (for QIMIA: its token attention and feed-forward widths)."""
    cfg = model.pretrained_cfg
    block = model.blocks[0]
    if isinstance(model, VisionTransformerQimia):
        attn, hidden = block.attn.body, block.mlp.body[0].out_features
    else:
        attn, hidden = block.attn, block.mlp.readout.in_features
    return dict(
        model_name='vit_base_patch16_224',
        img_size=cfg['input_size'][-1],
        patch_size=model.patch_embed.patch_size[0],
        embed_dim=model.embed_dim,
        depth=len(model.blocks),
        num_heads=attn.num_heads,
        mlp_ratio=hidden / model.embed_dim,
        qkv_bias=attn.qkv.bias is not None,
        num_classes=model.num_classes,
    )


def build(spec: dict, device: str) -> torch.nn.Module:
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

        @torch.inference_mode()
        def step():
            with torch.autocast(device_type, dtype=torch.bfloat16, enabled=amp):
                model(batch)
    return step


def sync(device: str) -> None:
    if device == 'cuda':
        torch.cuda.synchronize()


def throughput(specs: dict, input_size: tuple, batch_size: int, train: bool, args) -> dict:
    """Images/s of each model, interleaved over rounds; returns the median and all rounds."""
    steps = {}
    for name, spec in specs.items():
        model = build(spec, args.device)
        if args.compile:
            model = torch.compile(model)
        batch = torch.randn(batch_size, *input_size, device=args.device)
        steps[name] = make_step(model, batch, train, args.amp)
        for _ in range(args.warmup):
            steps[name]()
        sync(args.device)
    rounds = {name: [] for name in specs}
    for _ in range(args.rounds):
        for name, step in steps.items():
            sync(args.device)
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            sync(args.device)
            rounds[name].append(batch_size * args.steps / (time.perf_counter() - start))
    return {name: dict(median=statistics.median(r), rounds=r) for name, r in rounds.items()}


def peak_memory(spec: dict, input_size: tuple, batch_size: int, train: bool, args) -> float:
    """Peak memory in MiB of a few steps of one model, measured in a fresh process."""
    spec = dict(spec, input_size=list(input_size))
    cmd = [sys.executable, __file__, '--measure-memory', json.dumps(spec), '--batch-size', str(batch_size),
           '--device', args.device] + (['--train'] if train else []) + (['--amp'] if args.amp else []) + \
          (['--compile'] if args.compile else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def proc_status_kib(field: str) -> int:
    with open('/proc/self/status') as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ':'))


def reset_peak_rss() -> int:
    """Reset the kernel's peak-RSS mark (Linux) and return the current RSS in KiB."""
    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')
    return proc_status_kib('VmRSS')


def measure_memory_here(spec: dict, batch_size: int, train: bool, args) -> float:
    input_size = spec.pop('input_size')
    rss_before = reset_peak_rss()
    model = build(spec, args.device)
    if args.compile:
        model = torch.compile(model)
    batch = torch.randn(batch_size, *input_size, device=args.device)
    if args.device == 'cuda':
        torch.cuda.reset_peak_memory_stats()
    step = make_step(model, batch, train, args.amp)
    for _ in range(3):
        step()
    sync(args.device)
    if args.device == 'cuda':
        return torch.cuda.max_memory_allocated() / 2 ** 20
    return (proc_status_kib('VmHWM') - rss_before) / 2 ** 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--models', nargs='+', help='candidate model names (default: the README cases)')
    parser.add_argument('--batch-size', type=int, help='batch size for every case (default: per case)')
    parser.add_argument('--device', default='cpu')
    parser.add_argument('--amp', action='store_true', help='bf16 autocast')
    parser.add_argument('--compile', action='store_true', help='torch.compile both models')
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

    cases = [(m, args.batch_size, args.batch_size) for m in args.models] if args.models else DEFAULT_CASES
    results = []
    for name, cpu_bs, cuda_bs in cases:
        batch_size = (cuda_bs if args.device == 'cuda' else cpu_bs) or (256 if args.device == 'cuda' else 32)
        candidate = dict(model_name=name)
        meta_model = timm.create_model(name, device='meta')
        input_size = tuple(meta_model.pretrained_cfg['input_size'])
        baseline = baseline_args(meta_model)
        specs = {name: candidate, 'timm ViT': baseline}
        for train in (False, True):
            speed = throughput(specs, input_size, batch_size, train, args)
            memory = {k: peak_memory(spec, input_size, batch_size, train, args) for k, spec in specs.items()}
            row = dict(
                model=name,
                baseline=baseline,
                mode='train' if train else 'infer',
                batch_size=batch_size,
                images_per_s=speed[name]['median'],
                baseline_images_per_s=speed['timm ViT']['median'],
                throughput_ratio=speed[name]['median'] / speed['timm ViT']['median'],
                peak_mib=memory[name],
                baseline_peak_mib=memory['timm ViT'],
                memory_ratio=memory[name] / memory['timm ViT'],
                rounds=speed,
            )
            results.append(row)
            print(f"{name} {row['mode']}: {row['images_per_s']:.1f} vs {row['baseline_images_per_s']:.1f} img/s "
                  f"({row['throughput_ratio']:.3f}x), {row['peak_mib']:.0f} vs {row['baseline_peak_mib']:.0f} MiB "
                  f"({row['memory_ratio']:.3f}x)", flush=True)

    env = dict(
        date=datetime.now(timezone.utc).isoformat(timespec='seconds'),
        device=torch.cuda.get_device_name() if args.device == 'cuda' else platform.processor() or platform.machine(),
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        timm=timm.__version__,
        timm_hbf=timm_hbf.__version__,
        python=platform.python_version(),
        command=' '.join([sys.executable.rsplit('/', 1)[-1]] + sys.argv),
        amp=args.amp,
        compile=args.compile,
    )
    print(f"\n{env['device']}, {env['threads']} threads, torch {env['torch']}, timm {env['timm']}"
          f"{', bf16 autocast' if args.amp else ''}{', torch.compile' if args.compile else ''}\n")
    print('| model | input | mode | batch | img/s | timm ViT img/s | ratio | peak MiB | timm ViT MiB | ratio |')
    print('|---|---|---|---|---|---|---|---|---|---|')
    for r in results:
        size = r['baseline']['img_size']
        print(f"| `{r['model']}` | {size}/{r['baseline']['patch_size']} | {r['mode']} | {r['batch_size']} | "
              f"{r['images_per_s']:.1f} | {r['baseline_images_per_s']:.1f} | {r['throughput_ratio']:.2f} | "
              f"{r['peak_mib']:.0f} | {r['baseline_peak_mib']:.0f} | {r['memory_ratio']:.2f} |")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, 'w') as f:
            json.dump(dict(environment=env, results=results), f, indent=2)


if __name__ == '__main__':
    main()
