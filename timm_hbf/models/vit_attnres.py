"""Attention Residuals (AttnRes, Kimi Team, 2026) for vision: timm's ViT whose residual adds are reads and writes of
a memory over depth (:class:`~timm_hbf.models.vit_qimia.AttnResBlock`), Full (every sublayer's output an entry) and
Block (the outputs of every two layers summed into one entry, AttnRes Eq. 6).

With zero queries every read is the uniform average of its entries, the residual stream divided by their count, and
every sublayer and the final norm of a pre-norm ViT apply LayerNorm first, which removes that scale: AttnRes on a
timm ViT's weights computes the ViT's function. The ``_patch16_224`` models take timm's ImageNet weights that way (their
tags are timm's, and ``pretrained=True`` loads timm's weights), to be fine-tuned with the queries learning where to
look.
"""
from typing import Any, Dict

from timm.models import generate_default_cfgs, get_pretrained_cfg, register_model

from ._builder import cifar10_weights, vit_cfg
from .vit_qimia import VisionTransformerQimia, create_vit_qimia

__all__ = []

PAPER = dict(paper_name='Attention Residuals (Kimi Team, 2026)', paper_ids='arXiv:2603.15031')
# each architecture (Full and Block alike): its tags, and the timm weights each tag loads
TIMM_WEIGHTS = {
    'tiny_patch16_224': dict(augreg_in21k_ft_in1k='vit_tiny_patch16_224.augreg_in21k_ft_in1k',
                             fb_in1k='deit_tiny_patch16_224.fb_in1k'),
    'small_patch16_224': dict(augreg_in21k_ft_in1k='vit_small_patch16_224.augreg_in21k_ft_in1k',
                              fb_in1k='deit_small_patch16_224.fb_in1k'),
    'base_patch16_224': dict(augreg2_in21k_ft_in1k='vit_base_patch16_224.augreg2_in21k_ft_in1k',
                             augreg_in21k_ft_in1k='vit_base_patch16_224.augreg_in21k_ft_in1k',
                             fb_in1k='deit_base_patch16_224.fb_in1k'),
    'deit3_small_patch16_224': dict(fb_in1k='deit3_small_patch16_224.fb_in1k'),
    'deit3_base_patch16_224': dict(fb_in1k='deit3_base_patch16_224.fb_in1k'),
}


def _cfg(**kwargs) -> Dict[str, Any]:
    return vit_cfg(cifar10=True, **PAPER, **kwargs)


def _timm_weights(name: str) -> Dict[str, Any]:
    """The cfg of timm's pretrained ViT ``name`` (``arch.tag``): its Hub repository, input size, normalisation and
    classes (timm's Hub files, not the original release's files and loader)."""
    cfg = get_pretrained_cfg(name).to_dict()
    return dict({k: v for k, v in cfg.items() if k not in ('architecture', 'tag', 'url', 'custom_load')}, **PAPER)


# The first tag of a model is its default; .untrained tags are architectures without weights.
default_cfgs = generate_default_cfgs({
    'vit_attnres_tiny.cifar10_30ep': _cfg(**cifar10_weights('vit_attnres_tiny.cifar10_30ep')),
    'vit_attnres_tiny.untrained': _cfg(),
    'vit_attnres_block_tiny.cifar10_short': _cfg(**cifar10_weights('vit_attnres_block_tiny.cifar10_short')),
    'vit_attnres_block_tiny.untrained': _cfg(),
    **{f'vit_attnres{kind}_{arch}.{tag}': _timm_weights(name)
       for kind in ('', '_block') for arch, tags in TIMM_WEIGHTS.items() for tag, name in tags.items()},
})

TINY = dict(embed_dim=192, depth=12, num_heads=3)
SMALL = dict(embed_dim=384, depth=12, num_heads=6)
BASE = dict(embed_dim=768, depth=12, num_heads=12)
DEIT3 = dict(no_embed_class=True, init_values=1e-6)  # DeiT III's blocks: layer scale; its positions: patches only
# Full AttnRes: keys from values, timm's ViT blocks, one query per sublayer
FULL = dict(keys_from_values=True, sublayer_values=True, depth_num_heads=1)
# Block AttnRes: blocks of two layers (4 sublayers), 6 blocks over 24 sublayers: AttnRes's implementation puts block
# boundaries between layers, and about 8 blocks recover most of Full AttnRes's gain
BLOCK = dict(FULL, memory_block_size=4)


@register_model
def vit_attnres_tiny(pretrained: bool = False, **kwargs) -> VisionTransformerQimia:
    """Full Attention Residuals at ViT-Ti size (192 wide, 12 layers, 3 heads, one depth head), patch 4 at 32 x 32."""
    return create_vit_qimia('vit_attnres_tiny', pretrained, dict(patch_size=4, **TINY, **FULL), **kwargs)


@register_model
def vit_attnres_block_tiny(pretrained: bool = False, **kwargs) -> VisionTransformerQimia:
    """Block Attention Residuals at ViT-Ti size, blocks of 2 layers, patch 4 at 32 x 32."""
    return create_vit_qimia('vit_attnres_block_tiny', pretrained, dict(patch_size=4, **TINY, **BLOCK), **kwargs)


@register_model
def vit_attnres_tiny_patch16_224(pretrained: bool = False, **kwargs) -> VisionTransformerQimia:
    """Full AttnRes, ViT-Ti/16 at 224 x 224 (timm's ViT-Ti and DeiT-Ti weights)."""
    return create_vit_qimia('vit_attnres_tiny_patch16_224', pretrained, dict(patch_size=16, **TINY, **FULL), **kwargs)


@register_model
def vit_attnres_block_tiny_patch16_224(pretrained: bool = False, **kwargs) -> VisionTransformerQimia:
    """Block AttnRes, ViT-Ti/16 at 224 x 224, blocks of 2 layers."""
    return create_vit_qimia('vit_attnres_block_tiny_patch16_224', pretrained, dict(patch_size=16, **TINY, **BLOCK),
                            **kwargs)


@register_model
def vit_attnres_small_patch16_224(pretrained: bool = False, **kwargs) -> VisionTransformerQimia:
    """Full AttnRes, ViT-S/16 at 224 x 224 (timm's ViT-S and DeiT-S weights)."""
    return create_vit_qimia('vit_attnres_small_patch16_224', pretrained, dict(patch_size=16, **SMALL, **FULL),
                            **kwargs)


@register_model
def vit_attnres_block_small_patch16_224(pretrained: bool = False, **kwargs) -> VisionTransformerQimia:
    """Block AttnRes, ViT-S/16 at 224 x 224, blocks of 2 layers."""
    return create_vit_qimia('vit_attnres_block_small_patch16_224', pretrained, dict(patch_size=16, **SMALL, **BLOCK),
                            **kwargs)


@register_model
def vit_attnres_base_patch16_224(pretrained: bool = False, **kwargs) -> VisionTransformerQimia:
    """Full AttnRes, ViT-B/16 at 224 x 224 (timm's ViT-B and DeiT-B weights)."""
    return create_vit_qimia('vit_attnres_base_patch16_224', pretrained, dict(patch_size=16, **BASE, **FULL), **kwargs)


@register_model
def vit_attnres_block_base_patch16_224(pretrained: bool = False, **kwargs) -> VisionTransformerQimia:
    """Block AttnRes, ViT-B/16 at 224 x 224, blocks of 2 layers."""
    return create_vit_qimia('vit_attnres_block_base_patch16_224', pretrained, dict(patch_size=16, **BASE, **BLOCK),
                            **kwargs)


@register_model
def vit_attnres_deit3_small_patch16_224(pretrained: bool = False, **kwargs) -> VisionTransformerQimia:
    """Full AttnRes, DeiT III-S/16 at 224 x 224: layer scale, positions for the patches alone."""
    return create_vit_qimia('vit_attnres_deit3_small_patch16_224', pretrained,
                            dict(patch_size=16, **SMALL, **DEIT3, **FULL), **kwargs)


@register_model
def vit_attnres_block_deit3_small_patch16_224(pretrained: bool = False, **kwargs) -> VisionTransformerQimia:
    """Block AttnRes, DeiT III-S/16 at 224 x 224, blocks of 2 layers."""
    return create_vit_qimia('vit_attnres_block_deit3_small_patch16_224', pretrained,
                            dict(patch_size=16, **SMALL, **DEIT3, **BLOCK), **kwargs)


@register_model
def vit_attnres_deit3_base_patch16_224(pretrained: bool = False, **kwargs) -> VisionTransformerQimia:
    """Full AttnRes, DeiT III-B/16 at 224 x 224: layer scale, positions for the patches alone."""
    return create_vit_qimia('vit_attnres_deit3_base_patch16_224', pretrained,
                            dict(patch_size=16, **BASE, **DEIT3, **FULL), **kwargs)


@register_model
def vit_attnres_block_deit3_base_patch16_224(pretrained: bool = False, **kwargs) -> VisionTransformerQimia:
    """Block AttnRes, DeiT III-B/16 at 224 x 224, blocks of 2 layers."""
    return create_vit_qimia('vit_attnres_block_deit3_base_patch16_224', pretrained,
                            dict(patch_size=16, **BASE, **DEIT3, **BLOCK), **kwargs)
