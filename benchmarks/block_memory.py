"""Peak memory of QIMIA's block memory (``memory_block_size``) against depth, eager and under ``torch.compile``, beside
timm's ViT of the same size: does memory grow with the number of summaries or with the number of blocks?

Every figure is the memory of a step as ``benchmarks/throughput.py`` measures it (a fresh process per model: the
parameters, buffers and optimizer state plus the step's peak above what the process held before it). ``--json PATH``
writes the results and the environment, and the Markdown table beside it (``.md``).

    python benchmarks/block_memory.py --compiled --json PATH        # the README table (depths 12, 24; n 1, 4, 5, 8)
"""
import argparse
import os
import sys

import timm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import throughput  # noqa: E402  (benchmarks/ is not a package)

MODEL = 'vit_qimia_tiny'


def measure(args) -> list:
    """One row per (depth, model): the peak MiB of every execution, and its ratio to the ViT's."""
    rows = []
    for depth in args.depths:
        meta_model = timm.create_model(MODEL, device='meta', depth=depth)
        input_size = tuple(meta_model.pretrained_cfg['input_size'])
        specs = {f'{MODEL}, memory_block_size={n}': dict(model_name=MODEL, depth=depth, memory_block_size=n)
                 for n in args.block_sizes}
        specs[throughput.REFERENCE] = throughput.vit_args(throughput.dimensions(meta_model))
        peaks = {label: {execution: throughput.peak_memory(spec, input_size, args.batch_size, args.train,
                                                           execution == 'compiled', args)
                         for execution in throughput.executions(args)}
                 for label, spec in specs.items()}
        for label, peak in peaks.items():
            rows.append(dict(depth=depth, model=label, peak_mib=peak,
                             memory_ratio={e: mib / peaks[throughput.REFERENCE][e] for e, mib in peak.items()}))
            print(f"depth {depth}, {label}: " + ', '.join(
                f'{e} {mib:.0f} MiB ({rows[-1]["memory_ratio"][e]:.2f}x)' for e, mib in peak.items()), flush=True)
    return rows


def markdown_table(rows: list, executions: tuple) -> str:
    header = '| depth | model | ' + ' | '.join(f'{e} peak MiB | ratio to ViT' for e in executions) + ' |'
    lines = [header, '|' + '---|' * (2 + 2 * len(executions))]
    for row in rows:
        cells = ' | '.join(f"{row['peak_mib'][e]:.0f} | {row['memory_ratio'][e]:.2f}" for e in executions)
        lines.append(f"| {row['depth']} | `{row['model']}` | {cells} |")
    return '\n'.join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--depths', type=int, nargs='+', default=[12, 24])
    parser.add_argument('--block-sizes', type=int, nargs='+', default=[1, 4, 5, 8])
    parser.add_argument('--batch-size', type=int, default=128)
    parser.add_argument('--train', action='store_true', help='a training step (default: inference)')
    parser.add_argument('--device', default='cpu')
    parser.add_argument('--amp', action='store_true', help='bf16 autocast')
    parser.add_argument('--compiled', action='store_true', help='also measure under torch.compile')
    parser.add_argument('--json', help='write the results to this JSON file')
    args = parser.parse_args()

    rows = measure(args)
    env = dict(throughput.environment(args), mode='train' if args.train else 'infer', batch_size=args.batch_size)
    table = markdown_table(rows, throughput.executions(args))
    title = f"{env['device']}, torch {env['torch']}, timm {env['timm']}, {env['mode']}, batch {args.batch_size}, " \
            f"{env['date']}"
    print(f'\n{title}\n\n{table}')
    if args.json:
        throughput.write_results(args.json, env, rows, f'{title}\n\n{table}')


if __name__ == '__main__':
    main()
