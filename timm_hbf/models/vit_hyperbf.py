"""HyperBF Vision Transformer: "A Homogeneous Transformer Architecture" (Gan & Poggio, CBMM Memo 143, 2023).

Both halves of every block are HyperBF units (memo Eq. 1):

    x = x + HyperBFAttention(LayerNorm(x))        Gaussian kernel between queries and keys (Eq. 6)
    x = x + HyperBFMlp(LayerNorm(x))              Gaussian kernel between tokens and learned centres (Eq. 7)

The rest is a standard ViT: patch embedding, class token, learned position embedding, final norm, linear head.
The 32 x 32 models use patch 4, the CIFAR setting of the memo; ``*_patch16_224`` models are the ImageNet-scale
counterparts with the ViT-Ti/S/B widths. ``vit_hyperbf_memo143_patch4_32`` is the configuration the memo trained
(Table 2): width 768, 4 blocks, 4 heads, 3000 centres, one attention width per layer.
"""
from typing import Any, Dict, Optional, Tuple, Union

import torch
from timm.data import IMAGENET_INCEPTION_MEAN, IMAGENET_INCEPTION_STD
from timm.layers import DropPath, LayerScale
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from torch import nn

from ..layers import HyperBFAttention, HyperBFMlp
from ._token_vit import CIFAR10_MEAN, CIFAR10_STD, TokenViT, checkpoint_filter_fn

__all__ = ['HyperBFBlock', 'VisionTransformerHyperBF']

class HyperBFBlock(nn.Module):
    """Pre-norm block with both residuals (memo Eq. 1), optional layer scale and stochastic depth."""

    def __init__(
            self,
            dim: int,
            num_heads: int,
            mlp_ratio: float = 4.,
            qkv_bias: bool = True,
            attn_gamma_per_head: bool = True,
            kernel: str = 'gaussian',
            mahalanobis: bool = False,
            mlp_normalized: bool = False,
            init_values: Optional[float] = None,
            proj_drop: float = 0.,
            attn_drop: float = 0.,
            drop_path: float = 0.,
            device=None,
            dtype=None,
    ) -> None:
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        self.norm1 = nn.LayerNorm(dim, eps=1e-6, **dd)
        self.attn = HyperBFAttention(
            dim,
            num_heads=num_heads,
            qkv_bias=qkv_bias,
            gamma_per_head=attn_gamma_per_head,
            kernel=kernel,
            mahalanobis=mahalanobis,
            attn_drop=attn_drop,
            proj_drop=proj_drop,
            **dd,
        )
        self.ls1 = LayerScale(dim, init_values=init_values, **dd) if init_values else nn.Identity()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0. else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=1e-6, **dd)
        self.mlp = HyperBFMlp(
            dim,
            hidden_features=int(dim * mlp_ratio),
            kernel=kernel,
            mahalanobis=mahalanobis,
            normalized=mlp_normalized,
            drop=proj_drop,
            **dd,
        )
        self.ls2 = LayerScale(dim, init_values=init_values, **dd) if init_values else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0. else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x))))
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        return x


class VisionTransformerHyperBF(TokenViT):
    """Vision Transformer whose attention and MLP are HyperBF units.

    Args:
        img_size: Input image size.
        patch_size: Patch size.
        in_chans: Number of image channels.
        num_classes: Number of classes of the head (0 for none).
        global_pool: ``'token'`` (class token), ``'avg'`` (mean of patch tokens) or ``''`` (no pooling).
        embed_dim: Token width.
        depth: Number of blocks.
        num_heads: Attention heads.
        mlp_ratio: Centres per HyperBF MLP, as a multiple of ``embed_dim``.
        qkv_bias: Bias on the q, k, v projection.
        attn_gamma_per_head: One attention width per head (default) or one per layer (as the authors' code).
        kernel: ``'gaussian'`` (default) or ``'laplacian'`` for every HyperBF unit.
        mahalanobis: Learn a Mahalanobis metric in every HyperBF layer (identity at init).
        mlp_normalized: Softmax-normalised HyperBF MLP units (attention over learned centres).
        init_values: Layer-scale init; None disables layer scale.
        class_token: Prepend a class token.
        dynamic_img_size: Accept any input size, resampling the position embedding on the fly.
        dynamic_img_pad: Pad inputs whose size is not a multiple of the patch size.
        drop_rate: Dropout before the head.
        pos_drop_rate: Dropout after the position embedding.
        proj_drop_rate: Dropout after the attention projection and in the HyperBF MLP.
        attn_drop_rate: Dropout on the attention weights.
        drop_path_rate: Stochastic depth rate, growing linearly to this value in the last block.
        weight_init: ``''`` for the ViT init, ``'skip'`` to leave parameters uninitialised (weights loaded next).
    """

    def __init__(
            self,
            img_size: Union[int, Tuple[int, int]] = 224,
            patch_size: Union[int, Tuple[int, int]] = 16,
            in_chans: int = 3,
            num_classes: int = 1000,
            global_pool: str = 'token',
            embed_dim: int = 768,
            depth: int = 12,
            num_heads: int = 12,
            mlp_ratio: float = 4.,
            qkv_bias: bool = True,
            attn_gamma_per_head: bool = True,
            kernel: str = 'gaussian',
            mahalanobis: bool = False,
            mlp_normalized: bool = False,
            init_values: Optional[float] = None,
            class_token: bool = True,
            dynamic_img_size: bool = False,
            dynamic_img_pad: bool = False,
            drop_rate: float = 0.,
            pos_drop_rate: float = 0.,
            proj_drop_rate: float = 0.,
            attn_drop_rate: float = 0.,
            drop_path_rate: float = 0.,
            weight_init: str = '',
            device=None,
            dtype=None,
    ) -> None:
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        self._init_stem(
            img_size, patch_size, in_chans, embed_dim, class_token, pos_drop_rate, dynamic_img_size, dynamic_img_pad,
            **dd,
        )
        dpr = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]  # stochastic depth grows linearly
        self.blocks = nn.Sequential(*[
            HyperBFBlock(
                embed_dim,
                num_heads,
                mlp_ratio=mlp_ratio,
                qkv_bias=qkv_bias,
                attn_gamma_per_head=attn_gamma_per_head,
                kernel=kernel,
                mahalanobis=mahalanobis,
                mlp_normalized=mlp_normalized,
                init_values=init_values,
                proj_drop=proj_drop_rate,
                attn_drop=attn_drop_rate,
                drop_path=dpr[i],
                **dd,
            )
            for i in range(depth)
        ])
        self._init_head(num_classes, global_pool, drop_rate, depth, **dd)
        self.init_weights(weight_init)


def _create_vit_hyperbf(variant: str, pretrained: bool = False, **kwargs) -> VisionTransformerHyperBF:
    out_indices = kwargs.pop('out_indices', 3)
    return build_model_with_cfg(
        VisionTransformerHyperBF,
        variant,
        pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(out_indices=out_indices, feature_cls='getter'),
        **kwargs,
    )


def _cfg(**kwargs) -> Dict[str, Any]:
    return {
        'url': '',
        'num_classes': 1000,
        'input_size': (3, 224, 224),
        'pool_size': None,
        'crop_pct': 0.9,
        'interpolation': 'bicubic',
        'fixed_input_size': True,
        'mean': IMAGENET_INCEPTION_MEAN,
        'std': IMAGENET_INCEPTION_STD,
        'first_conv': 'patch_embed.proj',
        'classifier': 'head',
        'license': 'apache-2.0',
        'paper_name': 'A Homogeneous Transformer Architecture',
        **kwargs,
    }


def _cifar_cfg(**kwargs) -> Dict[str, Any]:
    return _cfg(num_classes=10, input_size=(3, 32, 32), crop_pct=1.0, mean=CIFAR10_MEAN, std=CIFAR10_STD, **kwargs)


# Only architectures for now: no tag points at weights until weights are published.
default_cfgs = generate_default_cfgs({
    'vit_hyperbf_tiny.untrained': _cifar_cfg(),
    'vit_hyperbf_small.untrained': _cifar_cfg(),
    'vit_hyperbf_base.untrained': _cifar_cfg(),
    'vit_hyperbf_memo143_patch4_32.untrained': _cifar_cfg(),
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
    """The CBMM Memo 143 configuration: 768 wide, 4 blocks, 4 heads, 3000 centres, one attention width per layer,
    no qkv bias, patch 4 at 32 x 32."""
    model_args = dict(
        patch_size=4, embed_dim=768, depth=4, num_heads=4, mlp_ratio=3000 / 768, qkv_bias=False,
        attn_gamma_per_head=False,
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
