"""How far each block's MLP is from an affine map, on real test images: for every block of a ViT-shaped model
(timm's ViT, the HyperBF ViT), the best affine map from the MLP's input tokens to its output tokens is fitted on half
of the tokens, and its R^2 measured on the other half (1: the MLP is affine on this data; a GELU MLP of a trained
ViT-Ti scores about 0.8). For HyperBF MLPs it also prints how much each unit's exponent ``log K(x, t_i)`` varies over
the tokens (median over units of its standard deviation): where it is well below 1, ``exp`` is nearly linear there;
and the block's learned widths ``gamma``, its MLP units' (smallest, median, largest) and, in a HyperBF attention,
its heads' (smallest, largest).

    python examples/mlp_linearity.py --model vit_hyperbf_tiny --pretrained
    python examples/mlp_linearity.py --model vit_tiny_patch16_224 --checkpoint RUN/last.pth.tar \\
        --model-kwargs img_size=32 patch_size=4 num_classes=10 --img-size 32 --crop-pct 1.0 \\
        --mean 0.4914 0.4822 0.4465 --std 0.247 0.2435 0.2616

``--data`` takes CIFAR-10 as for ``train_cifar10.py`` (default: the repository's sample); ``--img-size``,
``--crop-pct``, ``--mean`` and ``--std`` override the model's data config, as in timm's validate.py (timm's ViT
config crops 0.9 of the image; the CIFAR-10 recipes train and evaluate on whole 32 x 32 images).
"""
import argparse
from typing import Dict, Optional, Sequence

import torch
from train_cifar10 import add_model_arguments, check_model_arguments, model_and_test_images

from timm_hbf.layers import HyperBFAttention, HyperBFMlp
from timm_hbf.models import VisionTransformerQimia


def held_out_r2(inputs: torch.Tensor, outputs: torch.Tensor) -> float:
    """R^2 on the second half of the rows of the least-squares affine map fitted on the first half."""
    x = torch.cat([inputs, torch.ones(len(inputs), 1, dtype=inputs.dtype)], dim=1)
    half = len(x) // 2
    solution = torch.linalg.lstsq(x[:half], outputs[:half]).solution
    residual = outputs[half:] - x[half:] @ solution
    return 1. - residual.square().sum().item() / (outputs[half:] - outputs[half:].mean(0)).square().sum().item()


@torch.no_grad()
def mlp_linearity(model: torch.nn.Module, images: torch.Tensor, max_tokens: int = 20000) -> Dict[str, list]:
    """``r2``: the held-out affine R^2 of every block's MLP; for HyperBF MLPs ``unit_spread``, the median over units
    of the standard deviation of ``log K`` over the tokens, and ``mlp_gamma``, the units' widths (smallest, median,
    largest); for HyperBF attentions ``attn_gamma``, the heads' widths (smallest, largest). Tokens are shuffled
    before the halves are cut."""
    captured = {}
    hooks = [block.mlp.register_forward_hook(lambda mlp, args, out, i=i: captured.update({i: (args[0], out)}))
             for i, block in enumerate(model.blocks)]
    try:
        model.eval()(images)
    finally:
        for hook in hooks:
            hook.remove()
    generator = torch.Generator().manual_seed(0)
    stats: Dict[str, list] = {'r2': [], 'unit_spread': [], 'mlp_gamma': [], 'attn_gamma': []}
    for i, block in enumerate(model.blocks):
        inputs, outputs = (t.reshape(-1, t.shape[-1]).double() for t in captured[i])
        order = torch.randperm(len(inputs), generator=generator)[:max_tokens]
        stats['r2'].append(held_out_r2(inputs[order], outputs[order]))
        if isinstance(block.mlp, HyperBFMlp):
            log_k = block.mlp.log_units(inputs[order].to(block.mlp.centers.dtype))
            stats['unit_spread'].append(log_k.std(0).median().item())
            gamma = block.mlp.kernel.gamma()
            stats['mlp_gamma'].append((gamma.min().item(), gamma.median().item(), gamma.max().item()))
        if isinstance(block.attn, HyperBFAttention):
            gamma = block.attn.kernel.gamma()
            stats['attn_gamma'].append((gamma.min().item(), gamma.max().item()))
    return stats


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, list]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, model='vit_hyperbf_tiny', images=200)
    parser.add_argument('--img-size', type=int, default=None, help="input size (default: the model's)")
    parser.add_argument('--crop-pct', type=float, default=None, help="centre-crop fraction (default: the model's)")
    parser.add_argument('--mean', type=float, nargs=3, default=None, help="input mean (default: the model's)")
    parser.add_argument('--std', type=float, nargs=3, default=None, help="input std (default: the model's)")
    args = parser.parse_args(argv)
    check_model_arguments(parser, args)

    model, images = model_and_test_images(args)
    if isinstance(model, VisionTransformerQimia) or not hasattr(model, 'blocks') \
            or not all(hasattr(block, 'mlp') for block in model.blocks):
        raise SystemExit(f'{args.model} has no blocks whose MLP maps tokens to tokens: use a ViT with a residual '
                         'stream (vit_hyperbf_*, vit_*).')
    stats = mlp_linearity(model, images)
    for i, r2 in enumerate(stats['r2']):
        line = f'block {i:>2}: affine R^2 {r2:.3f}'
        if stats['unit_spread']:
            smallest, median, largest = stats['mlp_gamma'][i]
            line += (f', unit exponent spread {stats["unit_spread"][i]:.3f}, '
                     f'MLP widths {smallest:.2e}-{largest:.2e} (median {median:.2e})')
        if stats['attn_gamma']:
            line += ', attention widths {:.3g}-{:.3g}'.format(*stats['attn_gamma'][i])
        print(line)
    return stats


if __name__ == '__main__':
    main()
