"""The HyperBF attention layer alone against timm's ``Attention`` of the same width and heads, over sequence lengths.

Two groups of contenders, each timed against its own reference in the same interleaved rounds:

* the layer: ``HyperBFAttention`` (its fused path, :func:`~timm_hbf.layers.hyperbf_attention.gaussian_sdpa`) against
  timm's ``Attention`` (qkv and output projections included), eager and, with ``--compiled``, both under
  ``torch.compile`` (compiled ratios are to the compiled ``Attention``);
* the core: ``gaussian_sdpa`` on q, k and v of one head width against ``F.scaled_dot_product_attention`` on the same
  tensors, with torch's choice of kernel and, with ``--backends``, under each SDPA backend forced in turn (the
  key-norm channel makes q and k one or two channels wider, padded to a multiple of 8 on CUDA: 72 for a head width
  of 64, which flash kernels round up to their 96-wide variant). ``--flex`` adds a candidate core that keeps the
  head width: FlexAttention with the key-norm row as a ``score_mod`` bias (compiled, as FlexAttention needs).

Training is a forward and a backward pass (with a fixed output gradient), inference a forward pass under
``torch.inference_mode``; ``--amp`` runs both under bf16 autocast (the cores then take bf16 q, k and v). Every
round times each contender's steps after one untimed step of its own, in a fixed rotation; a ratio is the median
over rounds of the contender's steps per second over its reference's in the same round (with the range over
rounds). On CUDA, peak memory of one step is ``torch.cuda.max_memory_allocated`` above what was allocated before
it. Before timing inference, every HyperBF contender is checked against the float32 formula with explicit
distances on one sequence (``error``: largest absolute difference over the largest absolute value of the formula).
``--json PATH`` writes every round and the environment, the Markdown table (``PATH`` with ``.md``) and a plot of
the ratios (``.png``), anew after every case, so that a run cut short keeps what it measured. A contender a backend
cannot run is recorded with its error instead of timings.

    python benchmarks/attention.py --device cuda --amp --compiled --backends flash efficient cudnn --flex \\
        --json benchmarks/results/gpu/attention/attention.json
    python benchmarks/attention.py --quick --json /tmp/attention.json       # a tiny rehearsal on the CPU
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time
from contextlib import nullcontext
from datetime import datetime, timezone
from typing import Callable, Dict, List, Optional

import timm
import torch
import torch.nn.functional as F
from timm.models.vision_transformer import Attention

import timm_hbf
from timm_hbf.layers import HyperBFAttention
from timm_hbf.layers.hyperbf_attention import gaussian_sdpa

LAYER, LAYER_COMPILED = 'layer', 'layer, compiled'
TIMM_ATTENTION, HYPERBF_ATTENTION = "timm Attention", 'HyperBFAttention'
SDPA, GAUSSIAN_SDPA, FLEX = 'SDPA', 'gaussian_sdpa', 'FlexAttention score_mod'
BACKENDS = ('flash', 'efficient', 'cudnn', 'math')


class Contender:
    """One thing to time: ``make_step(train)`` returns a step function; ``reference`` names the contender its ratio
    is to; ``check`` (HyperBF contenders) returns its relative error against the formula."""

    def __init__(self, label: str, group: str, reference: str, make_step: Callable[[bool], Callable[[], None]],
                 check: Optional[Callable[[], float]] = None) -> None:
        self.label, self.group, self.reference, self.make_step, self.check = label, group, reference, make_step, check


def backend_context(backend: Optional[str]):
    """SDPA restricted to one backend (``None``: torch's choice)."""
    if backend is None:
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([getattr(SDPBackend, {'flash': 'FLASH_ATTENTION', 'efficient': 'EFFICIENT_ATTENTION',
                                             'cudnn': 'CUDNN_ATTENTION', 'math': 'MATH'}[backend])])


def formula(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """``softmax_j(-gamma ||q_i - k_j||^2) v_j`` with explicit distances, in float32."""
    q, k, v, gamma = q.float(), k.float(), v.float(), gamma.float()
    return torch.softmax(-gamma * torch.cdist(q, k).square(), dim=-1) @ v


def relative_error(value: torch.Tensor, exact: torch.Tensor) -> float:
    return ((value.float() - exact).abs().max() / exact.abs().max()).item()


def layer_contenders(args, tokens: int, batch: int) -> List[Contender]:
    """HyperBFAttention against timm's Attention with the same width, heads and qkv bias, eager (and compiled)."""
    dim = args.heads * args.head_dim
    torch.manual_seed(0)
    layers = {TIMM_ATTENTION: Attention(dim, num_heads=args.heads, qkv_bias=True).to(args.device),
              HYPERBF_ATTENTION: HyperBFAttention(dim, num_heads=args.heads, qkv_bias=True).to(args.device)}
    layers[HYPERBF_ATTENTION].load_state_dict(layers[TIMM_ATTENTION].state_dict(), strict=False)
    if not layers[HYPERBF_ATTENTION].fused_attn:
        raise SystemExit('HyperBFAttention is not on its fused path (TIMM_FUSED_ATTN=0?): nothing to measure.')
    x = torch.randn(batch, tokens, dim, device=args.device)
    grad = torch.randn_like(x)

    def stepper(layer: torch.nn.Module) -> Callable[[bool], Callable[[], None]]:
        def make_step(train: bool) -> Callable[[], None]:
            inputs = x.clone().requires_grad_(train)

            def step() -> None:
                with torch.set_grad_enabled(train), torch.inference_mode(not train), autocast(args):
                    out = layer(inputs)
                if train:
                    out.backward(grad.to(out.dtype))
                    layer.zero_grad(set_to_none=True)
                    inputs.grad = None
            return step
        return make_step

    def check_layer(layer: torch.nn.Module) -> Callable[[], float]:
        """The whole batch through ``layer`` (the shapes it was compiled for), the first sequence against the formula
        on the same projections."""
        def check() -> float:
            with torch.inference_mode(), autocast(args):
                out = layer(x)[:1]
                N, C = x.shape[1:]
                q, k, v = layer.qkv(x[:1]).float().reshape(1, N, 3, args.heads, -1).permute(2, 0, 3, 1, 4)
                exact = formula(q, k, v, layer.kernel.gamma().view(-1, 1, 1))
                exact = layer.proj(exact.transpose(1, 2).reshape(1, N, C).to(out.dtype)).float()
            return relative_error(out, exact)
        return check

    contenders = [Contender(label, LAYER, TIMM_ATTENTION, stepper(layer),
                            check_layer(layer) if label == HYPERBF_ATTENTION else None)
                  for label, layer in layers.items()]
    if args.compiled:
        compiled = {label: torch.compile(layer, dynamic=False) for label, layer in layers.items()}
        contenders += [Contender(f'{label}, compiled', LAYER_COMPILED, f'{TIMM_ATTENTION}, compiled', stepper(layer),
                                 check_layer(layer) if label == HYPERBF_ATTENTION else None)
                       for label, layer in compiled.items()]
    return contenders


def core_contenders(args, tokens: int, batch: int) -> List[Contender]:
    """gaussian_sdpa against SDPA on the same q, k, v, under torch's choice of kernel and each backend asked for;
    FlexAttention with a key-bias score_mod with ``--flex``."""
    dtype = torch.bfloat16 if args.amp else torch.float32
    shape = (batch, args.heads, tokens, args.head_dim)
    torch.manual_seed(0)
    q, k, v = (torch.randn(shape, device=args.device, dtype=dtype) for _ in range(3))
    gamma = torch.linspace(0.5, 2., args.heads, device=args.device).view(-1, 1, 1) / (2. * args.head_dim ** .5)
    grad = torch.randn_like(q)

    def stepper(attend: Callable, backend: Optional[str]) -> Callable[[bool], Callable[[], None]]:
        def make_step(train: bool) -> Callable[[], None]:
            leaves = [t.clone().requires_grad_(train) for t in (q, k, v, gamma)]

            def step() -> None:
                with torch.set_grad_enabled(train), torch.inference_mode(not train), backend_context(backend):
                    out = attend(*leaves)
                    if train:
                        out.backward(grad)
                for t in leaves:
                    t.grad = None
            return step
        return make_step

    def check(attend: Callable, backend: Optional[str]) -> Callable[[], float]:
        def run() -> float:
            with torch.inference_mode(), backend_context(backend):
                out = attend(q, k, v, gamma)[:1]
            return relative_error(out, formula(q[:1], k[:1], v[:1], gamma))
        return run

    def sdpa(q_, k_, v_, gamma_):
        return F.scaled_dot_product_attention(q_, k_, v_)

    contenders = []
    for backend in [None, *args.backends]:
        suffix = f' [{backend}]' if backend else ''
        contenders += [Contender(SDPA + suffix, 'core' + suffix, SDPA + suffix, stepper(sdpa, backend)),
                       Contender(GAUSSIAN_SDPA + suffix, 'core' + suffix, SDPA + suffix,
                                 stepper(gaussian_sdpa, backend), check(gaussian_sdpa, backend))]
    if args.flex:
        flex = flex_gaussian()
        contenders.append(Contender(FLEX, 'core', SDPA, stepper(flex, None), check(flex, None)))
    return contenders


def flex_gaussian() -> Callable:
    """Gaussian attention through FlexAttention (compiled): the queries scaled by ``2 gamma``, the key-norm term
    ``-gamma ||k_j||^2`` added to each logit by ``score_mod``; q, k and v keep their head width."""
    from torch.nn.attention.flex_attention import flex_attention
    compiled = torch.compile(flex_attention, dynamic=False)

    def attend(q, k, v, gamma):
        key_term = (-gamma.view(-1, 1) * k.float().square().sum(-1)).to(q.dtype)  # (B, H, N)

        def key_bias(score, b, h, q_idx, kv_idx):
            return score + key_term[b, h, kv_idx]
        return compiled((2. * gamma * q).to(q.dtype), k, v, score_mod=key_bias, scale=1.)
    return attend


def autocast(args):
    return torch.autocast(args.device.split(':')[0], dtype=torch.bfloat16, enabled=args.amp)


def sync(device: str) -> None:
    if device.startswith('cuda'):
        torch.cuda.synchronize()


def peak_mib(step: Callable[[], None], device: str) -> Optional[float]:
    """CUDA memory one step allocates at its peak, above what was allocated before it; ``None`` on the CPU."""
    if not device.startswith('cuda'):
        return None
    sync(device)
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    sync(device)
    return (torch.cuda.max_memory_allocated() - before) / 2 ** 20


def measure(contenders: List[Contender], train: bool, args) -> Dict[str, Dict]:
    """Every contender's steps per second over interleaved rounds, its paired ratio to its reference, its peak
    memory and its error against the formula; or the error that stopped it."""
    steps, results = {}, {}
    for c in contenders:
        try:
            step = c.make_step(train)
            for _ in range(args.warmup):
                step()
            sync(args.device)
            results[c.label] = dict(group=c.group, reference=c.reference,
                                    error=c.check() if c.check and not train else None,
                                    peak_mib=peak_mib(step, args.device), rounds=[])
            steps[c.label] = step
        except Exception as e:  # a backend that cannot run this case: recorded, the others go on
            results[c.label] = dict(group=c.group, reference=c.reference, unsupported=f'{type(e).__name__}: {e}')
    for _ in range(args.rounds):
        for label, step in steps.items():
            step()
            sync(args.device)
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            sync(args.device)
            results[label]['rounds'].append(args.steps / (time.perf_counter() - start))
    for label, r in results.items():
        reference = results.get(r['reference'], {})
        if 'rounds' not in r or not reference.get('rounds'):
            continue
        ratios = [a / b for a, b in zip(r['rounds'], reference['rounds'])]
        r.update(ratio=statistics.median(ratios), ratio_range=[min(ratios), max(ratios)])
    return results


def markdown_table(rows: List[Dict]) -> str:
    lines = ['| tokens | batch | mode | contender | ms/step | ratio to reference (range) | peak MiB | error |',
             '|---|---|---|---|---|---|---|---|']
    for row in rows:
        for label, r in row['contenders'].items():
            case = f"| {row['tokens']} | {row['batch']} | {row['mode']} | {label} |"
            if 'unsupported' in r:
                lines.append(f"{case} unsupported: {r['unsupported'][:80]} | | | |")
                continue
            ms = f"{1e3 / statistics.median(r['rounds']):.3f}"
            ratio = f"{r['ratio']:.2f} ({r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f})" if 'ratio' in r \
                else f"no reference ({r['reference']})"
            memory = '' if r['peak_mib'] is None else f"{r['peak_mib']:.0f}"
            error = '' if r['error'] is None else f"{r['error']:.1e}"
            lines.append(f'{case} {ms} | {ratio} | {memory} | {error} |')
    return '\n'.join(lines) + '\n'


def plot(rows: List[Dict], path: str) -> None:
    """Ratio to the reference against tokens, one panel per mode, one line per HyperBF contender."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    modes = sorted({r['mode'] for r in rows})
    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 3.6), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        series: Dict[str, List] = {}
        for row in (r for r in rows if r['mode'] == mode):
            for label, r in row['contenders'].items():
                if label != r['reference'] and 'ratio' in r:
                    series.setdefault(label, []).append((row['tokens'], r['ratio']))
        for label, points in series.items():
            ax.plot(*zip(*points), marker='o', label=label)
        ax.axhline(0.9, color='gray', linestyle=':', label='target 0.9')
        ax.set_xscale('log', base=2)
        ax.set_xlabel('tokens')
        ax.set_ylabel('speed ratio to its reference')
        ax.set_title(mode)
        ax.legend(fontsize=6)
        ax.grid(alpha=.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def environment(args) -> Dict:
    cuda = args.device.startswith('cuda')
    return dict(
        date=datetime.now(timezone.utc).isoformat(timespec='seconds'),
        device=torch.cuda.get_device_name() if cuda else f'CPU ({platform.processor() or platform.machine()})',
        threads=torch.get_num_threads(), torch=torch.__version__, cuda=torch.version.cuda if cuda else None,
        timm=timm.__version__, timm_hbf=timm_hbf.__version__, python=platform.python_version(),
        command=' '.join(['python', 'benchmarks/attention.py', *args.argv]), amp=args.amp, compiled=args.compiled,
        heads=args.heads, head_dim=args.head_dim, tokens_per_batch=args.tokens_per_batch,
        rounds=args.rounds, steps=args.steps, warmup=args.warmup,
    )


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    parser.add_argument('--amp', action='store_true', help='bf16 autocast')
    parser.add_argument('--compiled', action='store_true', help='also time both layers under torch.compile')
    parser.add_argument('--backends', nargs='*', default=[], choices=BACKENDS,
                        help='also time both cores under each of these SDPA backends')
    parser.add_argument('--flex', action='store_true', help='add FlexAttention with a key-bias score_mod')
    parser.add_argument('--heads', type=int, default=6)
    parser.add_argument('--head-dim', type=int, default=64)
    parser.add_argument('--tokens', type=int, nargs='+', default=[256, 512, 1024, 2048, 4096])
    parser.add_argument('--tokens-per-batch', type=int, default=65536, help='batch = this // tokens (at least 1)')
    parser.add_argument('--modes', nargs='+', default=['infer', 'train'], choices=['infer', 'train'])
    parser.add_argument('--warmup', type=int, default=3)
    parser.add_argument('--steps', type=int, default=10, help='steps per round')
    parser.add_argument('--rounds', type=int, default=7)
    parser.add_argument('--quick', action='store_true',
                        help='tiny sizes on the CPU: 2 heads, 16 and 32 tokens, 2 rounds of 1 step')
    parser.add_argument('--json', help='write the results to this JSON file (and .md, .png beside it)')
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.quick:
        args.device, args.heads, args.tokens, args.tokens_per_batch = 'cpu', 2, [16, 32], 64
        args.warmup, args.steps, args.rounds = 1, 1, 2
    return args


def save(record: Dict, path: str) -> None:
    """The JSON, the Markdown table and the plot of what has been measured so far."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, 'w') as f:
        json.dump(record, f, indent=2)
    stem = os.path.splitext(path)[0]
    with open(stem + '.md', 'w') as f:
        f.write(markdown_table(record['results']))
    plot(record['results'], stem + '.png')


def main(argv: Optional[List[str]] = None) -> Dict:
    args = parse_args(argv)
    record = dict(environment=environment(args), results=[])
    for tokens in args.tokens:
        batch = max(1, args.tokens_per_batch // tokens)
        if args.compiled or args.flex:
            torch._dynamo.reset()  # a fresh cache per length: each compiles for its own shapes
        contenders = layer_contenders(args, tokens, batch) + core_contenders(args, tokens, batch)
        for mode in args.modes:
            results = measure(contenders, mode == 'train', args)
            record['results'].append(dict(tokens=tokens, batch=batch, mode=mode, contenders=results))
            print(f'{tokens} tokens x {batch}, {mode}: ' + ', '.join(
                f"{label} {r['ratio']:.2f}x" if 'ratio' in r else f'{label} unsupported'
                for label, r in results.items() if label != r['reference']), flush=True)
            if args.json:  # after every case: a run cut short keeps what it measured
                save(record, args.json)
    print(f"\n{record['environment']['device']}, torch {torch.__version__}{', bf16 autocast' if args.amp else ''}\n")
    print(markdown_table(record['results']))
    return record


if __name__ == '__main__':
    main()
