"""Draw where a QIMIA or AttnRes model's sublayers read from: the mean depth-attention matrix (read x memory entry)
as a heatmap (:func:`depth_attention_stats`).

    python examples/depth_attention_heatmap.py --model vit_qimia_tiny --pretrained --out heatmap.png
    python examples/depth_attention_heatmap.py --checkpoint output/train_cifar10/vit_qimia_tiny/last.pth.tar \\
        --model vit_qimia_tiny --out heatmap.png

Rows are the reads (every sublayer, then the output read), columns the memory entries (the embedding's, then what
each sublayer wrote); each cell is the attention weight averaged over test images, tokens and heads. Untrained
models read uniformly (every row is 1 / entries seen, a residual stream's average). The entropy metric of the SURF
report (1: uniform, 0: a single entry) is printed per read. The numbers behind the heatmap go to a JSON file beside
it (``--out`` with ``.json``: the matrix, ``null`` where a read does not see an entry, the entropies and query norms,
row and column names). ``--out`` takes any format matplotlib writes (``.png``, ``.pdf``, ``.svg``, ...); a name
without a suffix gets ``.png``. ``--data`` takes CIFAR-10 as for ``train_cifar10.py`` (default: the repository's
sample). Needs matplotlib.
"""
import argparse
import json
import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
from script_checks import check_output
from train_cifar10 import add_model_arguments, check_model_arguments, model_and_test_images

from timm_hbf.layers import depth_weights, normalized_entropy
from timm_hbf.models import VisionTransformerQimia


@torch.no_grad()
def depth_attention_stats(model: VisionTransformerQimia, x: torch.Tensor) -> Dict[str, Any]:
    """Where a model's reads attend, for a batch ``x``, in eval mode (the model's mode is kept), float32 on the CPU:

    * ``matrix``: ``(reads, entries)``, the mean weight of each read (rows: every sublayer, then the output read) on
      each entry (columns); NaN where the read does not see the entry (not yet written, or merged into a summary in
      block memory: a summary is named by its newest member). A sublayer that takes a single entry weighs it 1.
    * ``entropy``: ``(reads,)``, the report's entropy metric: the mean normalised entropy of the weights (1: the
      uniform average, as a residual stream; 0: one entry);
    * ``query_norm``: ``(reads,)``, the norm of each read's query;
    * ``readers`` and ``entries``: row and column names.

    The weights are Eq. 1's softmax over the entries each read sees, recomputed from the entries the forward pass
    wrote (the model does not keep them).
    """
    read_out = model.read_out
    sublayers = []  # (name, read): a QIMIA layer holds two sublayers, each with its read; an AttnRes block two reads
    for i, layer in enumerate(model.blocks):
        for part, name in (('attn', 'read1'), ('mlp', 'read2')):
            read = getattr(layer, name) if model.sublayer_values else getattr(layer, part).read
            sublayers.append((f'{i}.{part}', read))
    written = []  # the newest entry at each read after the first: what the sublayer before it wrote
    hooks = [read.register_forward_pre_hook(lambda m, args: written.append((args[0].key, args[0].value)))
             for read in [read for _, read in sublayers[1:]] + [read_out]]
    was_training = model.training
    try:
        model.eval()
        stem = model.embed(x)
        model.forward_features(x)
    finally:
        model.train(was_training)
        for hook in hooks:
            hook.remove()
    entries = [(read_out.key(value if key is None else key), value) for key, value in stem]
    names = (['null'] if model.null_value is not None else []) + (['embed'] if model.sublayer_values else
                                                                   ['patch', 'pos'])
    columns = list(range(len(names)))  # the columns of the entries that a read sees
    reads = []  # (read, columns it sees, stored keys it sees)
    written_key = None  # the running summary's key, in block memory
    for (name, read), entry in zip(sublayers, written):
        merged = read.position > 0
        reads.append((read if read.query is not None else None, columns + ([len(names) - 1] if merged else []),
                      [k for k, _ in entries] + ([written_key] if merged else [])))
        if merged:
            names[-1] = name  # the running summary, named by its newest member
        else:
            names.append(name)
        written_key = entry[0]
        if read.commit:
            entries.append(entry)
            columns = columns + [len(names) - 1]
    out_merge = read_out.position > 0
    reads.append((read_out, columns + ([len(names) - 1] if out_merge else []),
                  [k for k, _ in entries] + ([written_key] if out_merge else [])))
    matrix = torch.full((len(reads), len(names)), math.nan)
    entropy, query_norm = [], []
    for row, (read, cols, keys) in enumerate(reads):
        if read is None:  # takes the one entry there is
            weights = torch.ones(1, 1)
        else:
            weights = depth_weights(read.memory_query(), keys, read.rms_logits).float().cpu()
        matrix[row, cols] = weights.reshape(-1, len(cols)).mean(0)
        entropy.append(normalized_entropy(weights))
        query_norm.append(read.query.float().norm().cpu() if read is not None else torch.zeros(()))
    return dict(matrix=matrix, entropy=torch.stack(entropy), query_norm=torch.stack(query_norm),
                readers=[name for name, _ in sublayers] + ['out'], entries=names)


def picture_path(parser: argparse.ArgumentParser, out: str) -> Path:
    """``--out`` as the picture's path: ``.png`` added where it has no suffix, else ``parser.error`` unless matplotlib
    writes its format and it and the numbers beside it (``.json``) can be written."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError:
        parser.error('the heatmap needs matplotlib: pip install matplotlib')
    path = Path(out)
    if not path.suffix:
        path = path.with_suffix('.png')
    formats = FigureCanvasAgg.get_supported_filetypes()
    if path.suffix[1:].lower() not in formats:
        parser.error(f"--out {out}: matplotlib writes no {path.suffix} picture (it writes .{', .'.join(formats)}); "
                     'the numbers go beside the picture as .json.')
    for written in (path, path.with_suffix('.json')):
        check_output(parser, '--out', written)
    return path


def draw(stats: Dict, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    matrix = stats['matrix'].numpy()
    fig, ax = plt.subplots(figsize=(0.32 * matrix.shape[1] + 2.5, 0.3 * matrix.shape[0] + 1.8))
    image = ax.imshow(matrix, cmap='viridis', vmin=0., aspect='auto')  # NaN (not yet written) stays blank
    ax.set_xticks(range(len(stats['entries'])), stats['entries'], rotation=90, fontsize=7)
    ax.set_yticks(range(len(stats['readers'])),
                  [f"{r}  H={h:.2f}" for r, h in zip(stats['readers'], stats['entropy'].tolist())], fontsize=7)
    ax.set_xlabel('memory entry (written by)')
    ax.set_ylabel('read (block), entropy')
    ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=ax, label='mean attention weight')
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def write_json(stats: Dict, path: Path, **about) -> None:
    """The heatmap's numbers, rounded to 4 decimals; ``null`` where a read does not see an entry."""
    def rounded(values: List[float]) -> List[Optional[float]]:
        return [None if math.isnan(v) else round(v, 4) for v in values]

    path.write_text(json.dumps(dict(
        about, readers=stats['readers'], entries=stats['entries'],
        matrix=[rounded(row) for row in stats['matrix'].tolist()],
        entropy=rounded(stats['entropy'].tolist()), query_norm=rounded(stats['query_norm'].tolist())), indent=1) + '\n')


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, model='vit_qimia_tiny', images=256)
    parser.add_argument('--out', default='depth_attention.png',
                        help='the picture, in any format matplotlib writes (no suffix: .png), and its numbers beside '
                             'it as .json (default: %(default)s)')
    args = parser.parse_args(argv)
    check_model_arguments(parser, args)
    out = picture_path(parser, args.out)

    model, batch = model_and_test_images(args)
    if not isinstance(model, VisionTransformerQimia):
        raise SystemExit(f'{args.model} has no depth attention: use a vit_qimia_* or vit_attnres_* model.')
    stats = depth_attention_stats(model, batch)
    for reader, entropy, norm in zip(stats['readers'], stats['entropy'].tolist(), stats['query_norm'].tolist()):
        print(f'{reader:>8}: entropy {entropy:.3f}, query norm {norm:.3f}')
    print(f"mean entropy {stats['entropy'].mean().item():.3f} over {len(stats['readers'])} reads")
    name = Path(args.checkpoint).name or (model.pretrained_cfg['tag'] if args.pretrained else 'untrained')
    draw(stats, out, f'{args.model} ({name}): mean depth attention on {len(batch)} test images')
    write_json(stats, out.with_suffix('.json'), model=args.model, weights=name, images=len(batch))
    print(f'heatmap written to {out}, its numbers to {out.with_suffix(".json")}')
    return stats


if __name__ == '__main__':
    main()
