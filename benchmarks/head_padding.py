"""What padding the Gaussian attention's operands to a multiple of 8 channels costs, against the same attention
unpadded, measured in one run.

The fused path of ``HyperBFAttention`` runs ``F.scaled_dot_product_attention`` on ``[q, 1] . [2 gamma k, -gamma
||k||^2]``: one channel wider than the head in float32, two in half precision, padded to a multiple of 8 (72 for a
64-wide head), the widths CUDA's flash and cuDNN kernels take in half precision. Padding is done on every device so
that there is one path. This script times that attention (``gaussian_sdpa``, ``channel_multiple=8``) against the
same attention unpadded (``channel_multiple=1``: 65 or 66 channels) at the shapes of ``--model``'s attention layers:
its forward pass under ``inference_mode`` and its forward and backward pass, interleaved round by round. A ratio is
the median over rounds of the padded attention's time over the unpadded one's in the same round, with its range.

Memory: the bytes autograd keeps for the backward pass (the storages of the tensors it saves, the parameters left
out), of one attention call either way and of one whole training forward pass of the model as built (padded): the
padding's share of what a training step keeps is the difference of the calls times the model's depth over that
total. ``--json PATH`` writes the environment (device, versions, command, date) and every round, with the Markdown
table beside it (``.md``).

    python benchmarks/head_padding.py --rounds 15 --steps 30 --json benchmarks/results/cpu_head_padding.json
    python benchmarks/head_padding.py --device cuda --amp --batch-size 1024 --rounds 15 --steps 30 --json padding.json
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from typing import Callable, Dict, Iterable, List, Optional

import timm
import torch
from throughput import check_counts, check_device, check_json, device_name, sync  # the speed benchmark's

import timm_hbf
from timm_hbf.layers.hyperbf_attention import gaussian_sdpa

MULTIPLES = {'padded': 8, 'unpadded': 1}


def attention_shape(model: torch.nn.Module, batch_size: int) -> List[int]:
    """``(B, heads, tokens, head_dim)`` of the q, k and v of ``model``'s attention layers."""
    attn = model.blocks[0].attn
    tokens = model.patch_embed.num_patches + model.num_prefix_tokens
    return [batch_size, attn.num_heads, tokens, attn.head_dim]


def operands(shape: List[int], device: str, dtype: torch.dtype, train: bool) -> List[torch.Tensor]:
    """q, k, v (unit-variance, as after the pre-norm and a projection at init) and one width per head."""
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=train) for _ in range(3))
    gamma = torch.full((shape[1], 1, 1), 0.5 / shape[-1] ** 0.5, device=device)
    return [q, k, v, gamma]


def make_call(multiple: int, shape: List[int], train: bool, args) -> Callable[[], None]:
    """One attention call: its forward pass under ``inference_mode``, or its forward and backward pass."""
    q, k, v, gamma = operands(shape, args.device, args.dtype, train)

    def call() -> None:
        if not train:
            with torch.inference_mode():
                gaussian_sdpa(q, k, v, gamma, channel_multiple=multiple)
            return
        gaussian_sdpa(q, k, v, gamma, channel_multiple=multiple).float().square().mean().backward()
    return call


def time_rounds(shape: List[int], train: bool, args) -> Dict[str, List[float]]:
    """Seconds per call of either attention in every round, interleaved."""
    calls = {label: make_call(multiple, shape, train, args) for label, multiple in MULTIPLES.items()}
    for call in calls.values():
        for _ in range(args.warmup):
            call()
    rounds: Dict[str, List[float]] = {label: [] for label in calls}
    for _ in range(args.rounds):
        for label, call in calls.items():
            call()  # untimed: the caches come back to this call after the other one's
            sync(args.device)
            start = time.perf_counter()
            for _ in range(args.steps):
                call()
            sync(args.device)
            rounds[label].append((time.perf_counter() - start) / args.steps)
    return rounds


def saved_bytes(run: Callable[[], torch.Tensor], parameters: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages autograd saves for the backward pass while ``run`` builds its graph, but for
    those of ``parameters`` (which a model holds anyway)."""
    held = {p.untyped_storage().data_ptr() for p in parameters}
    storages: Dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in held:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return sum(storages.values())


def memory(model: torch.nn.Module, shape: List[int], args) -> Dict[str, int]:
    """Bytes kept for the backward pass: of one attention call either way and of one training forward pass of
    ``model`` (its parameters left out), under bf16 autocast with ``--amp``."""
    found = {}
    for label, multiple in MULTIPLES.items():
        q, k, v, gamma = operands(shape, args.device, args.dtype, True)
        found[f'attention, {label}'] = saved_bytes(lambda: gaussian_sdpa(q, k, v, gamma, channel_multiple=multiple))
    images = torch.randn(shape[0], *model.pretrained_cfg['input_size'], device=args.device)
    with torch.autocast(images.device.type, dtype=torch.bfloat16, enabled=args.amp):
        found['model training step'] = saved_bytes(lambda: model.train()(images), model.parameters())
    return found


def report(record: dict) -> str:
    """The record as Markdown: its command and environment, then a table of the medians and the memory."""
    env, saved = record['environment'], record['saved_bytes']
    lines = [f"`{env['command']}`", '',
             f"{env['device']}, {env['threads']} threads, torch {env['torch']}, timm {env['timm']}, {env['date']}", '',
             f"{record['model']}'s attention, q, k and v {tuple(record['attention_shape'])}, {record['dtype']}:", '',
             '| | padded | unpadded | padded / unpadded (range over rounds) |', '|---|---|---|---|']
    for mode, name in (('infer', 'inference'), ('train', 'training (forward and backward)')):
        rounds, ratio = record['seconds_per_call'][mode], record['time_ratio'][mode]
        lines.append(f"| {name}, ms a call (median) | {1e3 * statistics.median(rounds['padded']):.2f} | "
                     f"{1e3 * statistics.median(rounds['unpadded']):.2f} | "
                     f"{ratio['median']:.3f} ({ratio['low']:.3f}-{ratio['high']:.3f}) |")
    padded, unpadded = saved['attention, padded'], saved['attention, unpadded']
    lines += [f'| kept for backward, MiB a call | {padded / 2**20:.2f} | {unpadded / 2**20:.2f} | '
              f'{padded / unpadded:.3f} |', '',
              f"The padding adds {100 * record['padding_share_of_training_memory']:.2f} % to the "
              f"{saved['model training step'] / 2**20:.1f} MiB a training step keeps for its backward pass."]
    return '\n'.join(lines) + '\n'


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--model', default='vit_hyperbf_tiny',
                        help='a HyperBF model whose attention shapes to take (default: %(default)s)')
    parser.add_argument('--batch-size', type=int, default=128)
    parser.add_argument('--device', default='cpu')
    parser.add_argument('--amp', action='store_true', help='q, k and v in bfloat16, as under bf16 autocast')
    parser.add_argument('--rounds', type=int, default=5)
    parser.add_argument('--steps', type=int, default=10, help='timed calls per round')
    parser.add_argument('--warmup', type=int, default=3)
    parser.add_argument('--json', help='write the environment and every round here (and the table beside it, .md)')
    args = parser.parse_args(argv)
    check_counts(parser, args, batch_size=1, rounds=1, steps=1, warmup=0)
    check_device(parser, args.device)
    if args.json:
        check_json(parser, args.json)
    args.dtype = torch.bfloat16 if args.amp else torch.float32
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def main(argv: Optional[List[str]] = None) -> dict:
    args = parse_args(argv)
    try:
        model = timm.create_model(args.model).to(args.device)
    except RuntimeError as e:  # not a registered name
        raise SystemExit(f'--model {args.model}: {e}') from e
    if not hasattr(model.blocks[0].attn, 'kernel'):
        raise SystemExit(f'--model {args.model}: its attention is not HyperBF attention; name a vit_hyperbf_* model.')
    shape = attention_shape(model, args.batch_size)
    speed = {mode: time_rounds(shape, mode == 'train', args) for mode in ('infer', 'train')}
    ratios = {mode: [p / u for p, u in zip(rounds['padded'], rounds['unpadded'])] for mode, rounds in speed.items()}
    saved = memory(model, shape, args)
    added = len(model.blocks) * (saved['attention, padded'] - saved['attention, unpadded'])
    record = dict(
        environment=dict(
            date=datetime.now(timezone.utc).isoformat(timespec='seconds'), device=device_name(args.device),
            threads=torch.get_num_threads(), torch=torch.__version__, timm=timm.__version__,
            timm_hbf=timm_hbf.__version__, python=platform.python_version(),
            command=' '.join(['python', 'benchmarks/head_padding.py', *args.argv])),
        model=args.model, attention_shape=shape, dtype=str(args.dtype).replace('torch.', ''),
        seconds_per_call=speed,
        time_ratio={mode: dict(median=statistics.median(r), low=min(r), high=max(r)) for mode, r in ratios.items()},
        saved_bytes=saved, padding_share_of_training_memory=added / saved['model training step'],
    )
    table = report(record)
    print(table, end='')
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(record, f, indent=2)
            f.write('\n')
        with open(os.path.splitext(args.json)[0] + '.md', 'w') as f:
            f.write(table)
    return record


if __name__ == '__main__':
    main()
