"""HyperBF Vision Transformer: "A Homogeneous Transformer Architecture" (Gan & Poggio, CBMM Memo 143, 2023).

timm's ``VisionTransformer`` whose attention and MLP are HyperBF units: every block is timm's pre-norm ``Block``,

    x = x + HyperBFAttention(LayerNorm(x))        Gaussian kernel between queries and keys (Eq. 6)
    x = x + HyperBFMlp(LayerNorm(x))              Gaussian kernel between tokens and learned centres (Eq. 4, 7)

the block of the authors' code, with both residuals. Memo Eq. 1, ``y = x + HyperBF(LN(x + HyperBF(LN(x))))``, read
literally adds only the second unit's output to the residual stream (the first one's reaches the output only through
the second); the code the memo was trained with adds both, as above.

The rest is timm's ViT, with all of its options (class and register tokens, position-embedding variants, pooling,
``dynamic_img_size``, layer scale, ...). The 32 x 32 models use patch 4, the CIFAR setting of the memo;
``*_patch16_224`` models are the ImageNet-scale counterparts with the ViT-Ti/S/B widths.
``vit_hyperbf_memo143_patch4_32`` is the configuration the memo trained (Table 2): width 768, 4 blocks, 4 heads,
3000 centres, one attention width per layer starting where the authors' code starts it. ``vit_hyperbf_nrbf_tiny``
has normalised MLP units (memo Eq. 2), which stay nonlinear where the default's become nearly affine
(docs/hyperbf.md).
"""
import math
from functools import partial
from typing import Any, Dict, Optional, Set

import torch
from timm.models import generate_default_cfgs, register_model
from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn

from .._checks import check_choice, check_positive, check_vit_arguments, fail
from ..layers import KERNELS, HyperBFAttention, HyperBFMlp
from ._builder import build_vit, cifar10_weights, vit_cfg

__all__ = ['VisionTransformerHyperBF']

# widths, centres and metrics: decay would pull the kernels towards zero width and the centres towards the origin
NO_DECAY_PARAM_NAMES = ('log_gamma', 'centers', 'metric')


def _layer_class(cls: type, **defaults) -> type:
    """``functools.partial(cls, **defaults)``, but a class: timm's ``Block`` takes its attention layer as a class
    (it calls ``issubclass`` on it). Calling the result builds a plain ``cls``."""
    class WithDefaults(cls):
        def __new__(_, *args, **kwargs):
            return cls(*args, **{**defaults, **kwargs})
    return WithDefaults


class VisionTransformerHyperBF(VisionTransformer):
    """timm's ``VisionTransformer`` with HyperBF attention and HyperBF MLPs.

    Takes every argument of ``VisionTransformer`` (``mlp_ratio`` sets the number of centres per MLP) but
    ``attn_layer`` and ``mlp_layer``, which it sets; ``block_fn`` must build the attention and MLP layers it is given
    (timm's ``Block``, ``ResPostBlock`` and ``ParallelThingsBlock`` do, ``ParallelScalingBlock`` fuses its own). And:

    Args:
        kernel: ``'gaussian'`` (default) or ``'laplacian'`` for every HyperBF unit.
        mahalanobis: Learn a Mahalanobis metric in every HyperBF layer (identity at init).
        mlp_normalized: Softmax-normalised HyperBF MLP units (attention over learned centres).
        attn_gamma_per_head: One attention width per head (default) or one per layer (as the authors' code).
        attn_gamma_init: Initial attention width, a finite number > 0 (``None``: ``1 / (2 sqrt(head_dim))``, see
            ``HyperBFAttention``).
    """

    def __init__(
            self,
            kernel: str = 'gaussian',
            mahalanobis: bool = False,
            mlp_normalized: bool = False,
            attn_gamma_per_head: bool = True,
            attn_gamma_init: Optional[float] = None,
            **kwargs,
    ) -> None:
        check_vit_arguments(kwargs)
        check_choice('kernel', kernel, KERNELS)
        if attn_gamma_init is not None:
            check_positive('attn_gamma_init (the initial attention width; None for the default)', attn_gamma_init)
        super().__init__(
            attn_layer=_layer_class(
                HyperBFAttention, kernel=kernel, mahalanobis=mahalanobis, gamma_per_head=attn_gamma_per_head,
                gamma_init=attn_gamma_init),
            mlp_layer=partial(HyperBFMlp, kernel=kernel, mahalanobis=mahalanobis, normalized=mlp_normalized),
            **kwargs,
        )
        if not all(any(isinstance(m, HyperBFAttention) for m in block.modules()) and
                   any(isinstance(m, HyperBFMlp) for m in block.modules()) for block in self.blocks):
            fail('block_fn', kwargs.get('block_fn'),
                 "a block that builds the attn_layer and mlp_layer it is given, as timm's Block (the default), "
                 "ResPostBlock and ParallelThingsBlock do (it built a block without HyperBF layers)")

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        """timm's (position embedding, class and register tokens) and every HyperBF width, centre and metric."""
        kernel_params = {n for n, _ in self.named_parameters() if n.rsplit('.', 1)[-1] in NO_DECAY_PARAM_NAMES}
        return set(super().no_weight_decay()) | kernel_params


def _create_vit_hyperbf(variant: str, pretrained: bool = False, **kwargs) -> VisionTransformerHyperBF:
    return build_vit(VisionTransformerHyperBF, variant, pretrained, checkpoint_filter_fn, **kwargs)


def _cfg(**kwargs) -> Dict[str, Any]:
    return vit_cfg(**{'paper_name': 'A Homogeneous Transformer Architecture', **kwargs})


# The first tag of a model is its default; .untrained tags are architectures without weights.
default_cfgs = generate_default_cfgs({
    'vit_hyperbf_tiny.cifar10_100ep': _cfg(cifar10=True, **cifar10_weights('vit_hyperbf_tiny.cifar10_100ep')),
    'vit_hyperbf_tiny.untrained': _cfg(cifar10=True),
    'vit_hyperbf_nrbf_tiny.cifar10_100ep': _cfg(
        cifar10=True, **cifar10_weights('vit_hyperbf_nrbf_tiny.cifar10_100ep')),
    'vit_hyperbf_nrbf_tiny.untrained': _cfg(cifar10=True),
    'vit_hyperbf_small.untrained': _cfg(cifar10=True),
    'vit_hyperbf_base.untrained': _cfg(cifar10=True),
    'vit_hyperbf_memo143_patch4_32.untrained': _cfg(cifar10=True),
    'vit_hyperbf_tiny_patch16_224.untrained': _cfg(),
    'vit_hyperbf_small_patch16_224.untrained': _cfg(),
    'vit_hyperbf_base_patch16_224.untrained': _cfg(),
})


@register_model
def vit_hyperbf_tiny(pretrained: bool = False, **kwargs) -> VisionTransformerHyperBF:
    """HyperBF ViT-Ti (192 wide, 12 blocks, 3 heads), patch 4 at 32 x 32."""
    model_args = dict(patch_size=4, embed_dim=192, depth=12, num_heads=3)
    return _create_vit_hyperbf('vit_hyperbf_tiny', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def vit_hyperbf_nrbf_tiny(pretrained: bool = False, **kwargs) -> VisionTransformerHyperBF:
    """HyperBF ViT-Ti whose MLPs are normalized RBF units (memo Eq. 2): a softmax over the learned centres, an
    associative memory of keys ``t_i`` and values ``c_i`` (``mlp_normalized=True``), patch 4 at 32 x 32."""
    model_args = dict(patch_size=4, embed_dim=192, depth=12, num_heads=3, mlp_normalized=True)
    return _create_vit_hyperbf('vit_hyperbf_nrbf_tiny', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def vit_hyperbf_small(pretrained: bool = False, **kwargs) -> VisionTransformerHyperBF:
    """HyperBF ViT-S (384 wide, 12 blocks, 6 heads), patch 4 at 32 x 32."""
    model_args = dict(patch_size=4, embed_dim=384, depth=12, num_heads=6)
    return _create_vit_hyperbf('vit_hyperbf_small', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def vit_hyperbf_base(pretrained: bool = False, **kwargs) -> VisionTransformerHyperBF:
    """HyperBF ViT-B (768 wide, 12 blocks, 12 heads), patch 4 at 32 x 32."""
    model_args = dict(patch_size=4, embed_dim=768, depth=12, num_heads=12)
    return _create_vit_hyperbf('vit_hyperbf_base', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def vit_hyperbf_memo143_patch4_32(pretrained: bool = False, **kwargs) -> VisionTransformerHyperBF:
    """The CBMM Memo 143 configuration: 768 wide, 4 blocks, 4 heads, 3000 centres, no qkv bias, patch 4 at 32 x 32;
    one attention width per layer, starting at ``head_dim ** -0.5`` as in the authors' code (their learned scale,
    which multiplies the squared distance). The MLP widths start at the data scale, not at the authors' 0.1, at which
    every unit is numerically zero (see ``HyperBFMlp``)."""
    model_args = dict(
        patch_size=4, embed_dim=768, depth=4, num_heads=4, mlp_ratio=3000 / 768, qkv_bias=False,
        attn_gamma_per_head=False, attn_gamma_init=1. / math.sqrt(768 // 4),
    )
    return _create_vit_hyperbf('vit_hyperbf_memo143_patch4_32', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def vit_hyperbf_tiny_patch16_224(pretrained: bool = False, **kwargs) -> VisionTransformerHyperBF:
    """HyperBF ViT-Ti/16 at 224 x 224."""
    model_args = dict(patch_size=16, embed_dim=192, depth=12, num_heads=3)
    return _create_vit_hyperbf('vit_hyperbf_tiny_patch16_224', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def vit_hyperbf_small_patch16_224(pretrained: bool = False, **kwargs) -> VisionTransformerHyperBF:
    """HyperBF ViT-S/16 at 224 x 224."""
    model_args = dict(patch_size=16, embed_dim=384, depth=12, num_heads=6)
    return _create_vit_hyperbf('vit_hyperbf_small_patch16_224', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def vit_hyperbf_base_patch16_224(pretrained: bool = False, **kwargs) -> VisionTransformerHyperBF:
    """HyperBF ViT-B/16 at 224 x 224."""
    model_args = dict(patch_size=16, embed_dim=768, depth=12, num_heads=12)
    return _create_vit_hyperbf('vit_hyperbf_base_patch16_224', pretrained=pretrained, **dict(model_args, **kwargs))
