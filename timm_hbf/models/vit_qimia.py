"""QIMIA Vision Transformer: Query Integrated Memory Interfacing Attention (Dugue, Caltech SURF report, 2023).

No residual stream: every block reads its input from a per-token memory of (key, value) entries through
learned-query attention over depth (report Eq. 1-2, :class:`~timm_hbf.layers.DepthAttention`) and writes one entry
of its own:

    memory   = [(patch embedding), (position embedding)]                      two separate entries (appendix)
    block l:   A_l = LayerNorm_noaffine( sum_i softmax_i(q_l . k_i) v_i )      over all entries so far
               h   = MultiHeadAttention(A_l)           or    h = Linear(A_l)  (attention / feed-forward block)
               k_l = Linear(PReLU(h)),  v_l = Linear(PReLU(h))                 separate key and value paths
    output:    a last read over every entry, then the class token, norm and linear head (timm's conventions)

A layer of ``depth`` is one attention block and one feed-forward block, as in a ViT, so ``depth`` 12 writes 24
entries. Queries start at zero: every read starts as the uniform average of the entries it sees. Report options:
``key_dim``, ``depth_num_heads``, ``key_norm``, ``value_norm='batchnorm'``, ``depth_kernel='gaussian'`` (L2
attention through the HyperBF kernel), path dropout (``drop_path_rate``), and a learned null entry. Beyond the
report: a block-memory mode (``memory_block_size``) that merges consecutive blocks' entries into summaries, so that
reads attend over a few summaries instead of every entry.
"""
import math
from functools import partial
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.fx
from timm.data import IMAGENET_INCEPTION_MEAN, IMAGENET_INCEPTION_STD
from timm.layers import Attention, resample_abs_pos_embed, trunc_normal_
from timm.models import build_model_with_cfg, checkpoint, generate_default_cfgs, register_model
from torch import nn

from ..layers import (
    DepthAttention,
    DepthKey,
    PReLULinear,
    TokenBatchNorm,
    memory_slots,
    normalized_entropy,
    write_entry,
)
from ._token_vit import CIFAR10_MEAN, CIFAR10_STD, TokenViT, checkpoint_filter_fn

__all__ = ['QimiaBlock', 'QimiaLayer', 'VisionTransformerQimia']

VALUE_NORMS = ('layernorm', 'batchnorm')

# torch.fx.wrap patches the globals of the module that calls it: keep memory writes (and their backward) as leaves here
torch.fx.wrap('write_entry')
Memory = Tuple[torch.Tensor, torch.Tensor, List[torch.Tensor], List[torch.Tensor]]


class QimiaBlock(nn.Module):
    """Read the memory, transform, write one (key, value) entry (report Fig. 8-9).

    Args:
        body: The transform of the read (multi-head attention, or the feed-forward block's shared Linear).
        body_dim: Width of the body's output.
        dim: Token (value) width.
        key_dim: Key width.
        depth_num_heads: Depth-attention heads.
        depth_kernel: ``'dot'`` or ``'gaussian'`` depth attention.
        key_norm: Unit-L2 keys (per head).
        value_norm: ``'layernorm'`` on every read, or ``'batchnorm'`` on every written value instead.
        path_drop: Dropout on this block's depth-attention weights.
        slot: The memory slot this block writes.
        summary_position: Block-memory mode: this block's place in its memory block. Past the first, the block
            merges its entry into the memory block's summary (the previous entry) instead of adding one: values
            summed (a residual stream within the memory block), keys averaged (a summary's logit is the mean of its
            members' logits, for either kernel).
    """

    def __init__(
            self,
            body: nn.Module,
            body_dim: int,
            dim: int,
            key_dim: int,
            depth_num_heads: int,
            depth_kernel: str = 'dot',
            key_norm: bool = False,
            value_norm: str = 'layernorm',
            path_drop: float = 0.,
            slot: int = 0,
            summary_position: int = 0,
            device=None,
            dtype=None,
    ) -> None:
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        self.slot = slot
        self.summary_position = summary_position
        self.read = DepthAttention(
            dim, key_dim, depth_num_heads, kernel=depth_kernel, norm=value_norm == 'layernorm', path_drop=path_drop,
            **dd,
        )
        self.body = body
        self.key = nn.Sequential(
            PReLULinear(body_dim, key_dim, **dd),
            DepthKey(key_dim, depth_num_heads, normalize=key_norm, kernel=depth_kernel),
        )
        self.value = nn.Sequential(
            PReLULinear(body_dim, dim, **dd),
            TokenBatchNorm(dim, **dd) if value_norm == 'batchnorm' else nn.Identity(),
        )

    def forward(
            self,
            keys: torch.Tensor,
            values: torch.Tensor,
            key_entries: List[torch.Tensor],
            value_entries: List[torch.Tensor],
    ) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """Returns the entries that the next read sees: these with this block's entry appended, or merged into the
        last (block-memory mode). The lists passed in are left as they are."""
        h = self.body(self.read(keys, key_entries, value_entries))
        key, value = self.key(h), self.value(h)
        if self.summary_position > 0:
            key = torch.lerp(key_entries[-1].to(key.dtype), key, 1. / (self.summary_position + 1))
            value = value_entries[-1] + value
            key_entries, value_entries = key_entries[:-1], value_entries[:-1]
        key, value = write_entry(keys, values, self.slot, key, value)
        return key_entries + [key], value_entries + [value]


class QimiaLayer(nn.Module):
    """One attention block and one feed-forward block, the QIMIA counterpart of a ViT block. ``slots``: the memory
    slots the two blocks write; ``summary_positions``: their places in their memory blocks (see :class:`QimiaBlock`)."""

    def __init__(
            self,
            dim: int,
            num_heads: int,
            key_dim: int,
            depth_num_heads: int,
            mlp_ratio: float = 4.,
            qkv_bias: bool = True,
            depth_kernel: str = 'dot',
            key_norm: bool = False,
            value_norm: str = 'layernorm',
            proj_drop: float = 0.,
            attn_drop: float = 0.,
            path_drop: float = 0.,
            slots: Tuple[int, int] = (0, 1),
            summary_positions: Tuple[int, int] = (0, 0),
            device=None,
            dtype=None,
    ) -> None:
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        hidden = int(dim * mlp_ratio)
        memory_args = dict(
            dim=dim, key_dim=key_dim, depth_num_heads=depth_num_heads, depth_kernel=depth_kernel, key_norm=key_norm,
            value_norm=value_norm, path_drop=path_drop, **dd,
        )
        attn = Attention(dim, num_heads=num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=proj_drop, **dd)
        self.attn = QimiaBlock(attn, dim, slot=slots[0], summary_position=summary_positions[0], **memory_args)
        self.mlp = QimiaBlock(
            nn.Sequential(nn.Linear(dim, hidden, **dd), nn.Dropout(proj_drop)), hidden,
            slot=slots[1], summary_position=summary_positions[1], **memory_args,
        )

    def forward(
            self,
            keys: torch.Tensor,
            values: torch.Tensor,
            key_entries: List[torch.Tensor],
            value_entries: List[torch.Tensor],
    ) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        key_entries, value_entries = self.attn(keys, values, key_entries, value_entries)
        return self.mlp(keys, values, key_entries, value_entries)


class VisionTransformerQimia(TokenViT):
    """Vision Transformer whose blocks read a memory of all earlier blocks' outputs instead of a residual stream.

    Args:
        img_size: Input image size.
        patch_size: Patch size.
        in_chans: Number of image channels.
        num_classes: Number of classes of the head (0 for none).
        global_pool: ``'token'`` (class token), ``'avg'`` (mean of patch tokens) or ``''`` (no pooling).
        embed_dim: Token (value) width.
        depth: Number of layers (each an attention block and a feed-forward block).
        num_heads: Heads of the token attention.
        mlp_ratio: Feed-forward hidden width, as a multiple of ``embed_dim``.
        qkv_bias: Bias on the token attention's q, k, v projection.
        key_dim: Width of the memory keys (and queries).
        depth_num_heads: Depth-attention heads (default ``key_dim // 8``, heads of 8 key channels as in the
            report's runs); they split keys and values.
        depth_kernel: ``'dot'`` (report Eq. 1) or ``'gaussian'`` (the report's L2 attention, HyperBF kernel).
        key_norm: Unit-L2 keys per head (the report's key normalisation).
        value_norm: ``'layernorm'`` (LayerNorm without affine on every read, the default) or ``'batchnorm'``
            (BatchNorm on every written value and no LayerNorm on reads).
        null_entry: A learned (key, value) entry that every read can attend to, to read (almost) nothing.
        memory_block_size: Block-memory mode, in the spirit of Block Attention Residuals: the entries of every
            ``memory_block_size`` consecutive blocks (attention and feed-forward blocks count separately) are merged
            into one summary, values summed and keys averaged, so that reads attend over the stem's entries, the
            finished summaries and the current one. 1 (the default) keeps every entry: QIMIA as in the report.
        class_token: Prepend a class token.
        dynamic_img_size: Accept any input size, resampling the position embedding on the fly.
        dynamic_img_pad: Pad inputs whose size is not a multiple of the patch size.
        drop_rate: Dropout before the head.
        pos_drop_rate: Dropout on the patch-embedding entry.
        proj_drop_rate: Dropout after the token attention and the feed-forward hidden layer.
        attn_drop_rate: Dropout on the token-attention weights.
        drop_path_rate: Path dropout: dropout on the depth-attention weights (report §6), growing linearly to this
            rate in the last layer.
        weight_init: ``''`` for the ViT init (queries zero), ``'skip'`` to leave parameters uninitialised.
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
            key_dim: int = 256,
            depth_num_heads: Optional[int] = None,
            depth_kernel: str = 'dot',
            key_norm: bool = False,
            value_norm: str = 'layernorm',
            null_entry: bool = False,
            memory_block_size: int = 1,
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
        if value_norm not in VALUE_NORMS:
            raise ValueError(f"Unknown value_norm '{value_norm}': use one of {VALUE_NORMS}.")
        if memory_block_size < 1:
            raise ValueError(
                f'memory_block_size must be at least 1 (1 keeps every entry), got {memory_block_size}.')
        dd = {'device': device, 'dtype': dtype}
        depth_num_heads = depth_num_heads or max(key_dim // 8, 1)
        self._init_stem(
            img_size, patch_size, in_chans, embed_dim, class_token, pos_drop_rate, dynamic_img_size, dynamic_img_pad,
            **dd,
        )
        memory_args = dict(depth_num_heads=depth_num_heads, depth_kernel=depth_kernel, key_norm=key_norm)
        self.read_out = DepthAttention(
            embed_dim, key_dim, depth_num_heads, kernel=depth_kernel, norm=value_norm == 'layernorm', **dd)
        self.key_format = DepthKey(key_dim, depth_num_heads, normalize=key_norm, kernel=depth_kernel)
        self.patch_key = nn.Linear(embed_dim, key_dim, **dd)
        self.pos_key = nn.Linear(embed_dim, key_dim, **dd)
        batchnorm = value_norm == 'batchnorm'
        self.patch_value_norm = TokenBatchNorm(embed_dim, **dd) if batchnorm else nn.Identity()
        self.pos_value_norm = TokenBatchNorm(embed_dim, **dd) if batchnorm else nn.Identity()
        self.null_key = nn.Parameter(torch.empty(key_dim, **dd)) if null_entry else None
        self.null_value = nn.Parameter(torch.empty(embed_dim, **dd)) if null_entry else None
        self.num_stem_entries = 2 + int(null_entry)
        path_drop = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]  # grows linearly, as drop path
        self.blocks = nn.ModuleList([  # layers take and return the memory, so not a Sequential
            QimiaLayer(
                embed_dim,
                num_heads,
                key_dim,
                mlp_ratio=mlp_ratio,
                qkv_bias=qkv_bias,
                value_norm=value_norm,
                proj_drop=proj_drop_rate,
                attn_drop=attn_drop_rate,
                path_drop=path_drop[i],
                slots=(self.num_stem_entries + 2 * i, self.num_stem_entries + 2 * i + 1),
                summary_positions=((2 * i) % memory_block_size, (2 * i + 1) % memory_block_size),
                **memory_args,
                **dd,
            )
            for i in range(depth)
        ])
        self._init_head(num_classes, global_pool, drop_rate, depth, **dd)
        self.init_weights(weight_init)

    def init_weights(self, mode: str = '') -> None:
        super().init_weights(mode)
        if mode != 'skip' and self.null_key is not None and self.null_value is not None:
            trunc_normal_(self.null_key, std=.02)
            nn.init.zeros_(self.null_value)

    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        return super().no_weight_decay() | ({'null_key', 'null_value'} if self.null_key is not None else set())

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict:
        return dict(
            stem=r'^cls_token|pos_embed|patch_embed|patch_key|pos_key|patch_value_norm|pos_value_norm|null_',
            blocks=[(r'^blocks\.(\d+)', None), (r'^read_out|^norm', (99999,))],
        )

    # --- memory -----------------------------------------------------------------------------------------------------

    @property
    def num_memory_entries(self) -> int:
        """Entries of a full forward pass: null entry (if any), patch and position embeddings, two per layer."""
        return self.num_stem_entries + 2 * len(self.blocks)

    def init_memory(self, x: torch.Tensor) -> Memory:
        """Images to the memory buffers, with the stem's entries written: ``(keys, values, key_entries,
        value_entries)``. Buffers hold every entry of a full pass; entry ``i`` is ``keys[i]``, ``values[i]``."""
        tokens = self.patch_embed(x)
        pos_embed = self.pos_embed
        if self.dynamic_img_size:
            B, H, W, C = tokens.shape
            pos_embed = resample_abs_pos_embed(pos_embed, new_size=[H, W], num_prefix_tokens=self.num_prefix_tokens)
            tokens = tokens.view(B, -1, C)
        if self.cls_token is not None:
            tokens = torch.cat([self.cls_token.expand(tokens.shape[0], -1, -1), tokens], dim=1)
        tokens = self.pos_drop(tokens)
        B, N, D = tokens.shape
        keys = tokens.new_empty((self.num_memory_entries, B, N, self.key_format.width))
        values = tokens.new_empty((self.num_memory_entries, B, N, D))
        entries: List[Tuple[torch.Tensor, torch.Tensor]] = []
        if self.null_key is not None and self.null_value is not None:
            entries.append((self.key_format(self.null_key), self.null_value))
        entries.append((self.key_format(self.patch_key(tokens)), self.patch_value_norm(tokens)))
        entries.append((self.key_format(self.pos_key(pos_embed)), self.pos_value_norm(pos_embed)))
        key_entries: List[torch.Tensor] = []
        value_entries: List[torch.Tensor] = []
        for i, (key, value) in enumerate(entries):
            key, value = write_entry(keys, values, i, key, value)
            key_entries.append(key)
            value_entries.append(value)
        return keys, values, key_entries, value_entries

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x, _ = self._forward_taken(x, [], len(self.blocks) - 1)
        return self.norm(x)

    def _forward_taken(self, x: torch.Tensor, taken: List[int], last: int) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """Layers ``0..last``, then the output read: its result before the final norm, and the values that the
        feed-forward blocks of the ``taken`` layers wrote (a layer's output: there is no residual stream; in
        block-memory mode, the summary it was merged into)."""
        keys, values, key_entries, value_entries = self.init_memory(x)
        intermediates: List[torch.Tensor] = []
        for i, layer in enumerate(self.blocks):
            if i <= last:
                if self.grad_checkpointing and not torch.jit.is_scripting():
                    # the buffers go in through the closure: checkpoint would otherwise save them and object to the
                    # later layers' writes; a recomputed layer rewrites its own entries with the same values
                    key_entries, value_entries = checkpoint(
                        partial(layer, keys, values), key_entries, value_entries, use_reentrant=False)
                else:
                    key_entries, value_entries = layer(keys, values, key_entries, value_entries)
                if i in taken:
                    intermediates.append(value_entries[-1])
        return self.read_out(keys, key_entries, value_entries), intermediates

    # --- diagnostics ------------------------------------------------------------------------------------------------

    @torch.jit.ignore
    def memory_entry_names(self) -> List[str]:
        """Names of the memory entries, in order: ``null``, ``patch``, ``pos``, then ``{layer}.attn``,
        ``{layer}.mlp``."""
        names = ['null'] if self.null_key is not None else []
        names += ['patch', 'pos']
        return names + [f'{i}.{part}' for i in range(len(self.blocks)) for part in ('attn', 'mlp')]

    @torch.jit.ignore
    def depth_attention_stats(self, x: torch.Tensor) -> Dict[str, Any]:
        """Depth-attention diagnostics for a batch, in eval mode and without gradients (the model's mode is kept):

        * ``matrix``: ``(reads, entries)`` mean attention weight of each read (rows: every block, then the output
          read) on each entry (columns, :meth:`memory_entry_names`); NaN where the read does not see the entry
          (not yet written, or in block-memory mode merged into a later summary, named by its last block);
        * ``entropy``: ``(reads,)`` the report's entropy metric, the mean normalised entropy of the weights
          (1: uniform over the entries, as a residual stream; 0: one entry);
        * ``query_norm``: ``(reads,)`` the norm of each read's query;
        * ``readers`` and ``entries``: row and column names.
        """
        was_training = self.training
        self.eval()
        try:
            with torch.no_grad():
                keys, values, key_entries, value_entries = self.init_memory(x)
                reads, weights, seen = [], [], []  # seen: the slots of the entries each read attends over
                for i, layer in enumerate(self.blocks):
                    for part, block in (('attn', layer.attn), ('mlp', layer.mlp)):
                        reads.append((f'{i}.{part}', block.read))
                        weights.append(block.read.weights(keys, key_entries))
                        seen.append(memory_slots(keys, key_entries))
                        key_entries, value_entries = block(keys, values, key_entries, value_entries)
                reads.append(('out', self.read_out))
                weights.append(self.read_out.weights(keys, key_entries))
                seen.append(memory_slots(keys, key_entries))
        finally:
            self.train(was_training)
        matrix = torch.full((len(weights), self.num_memory_entries), math.nan)
        for row, (w, slots) in enumerate(zip(weights, seen)):
            matrix[row, slots] = w.float().mean((1, 2, 3)).cpu()
        return dict(
            matrix=matrix,
            entropy=torch.stack([normalized_entropy(w.float()).cpu() for w in weights]),
            query_norm=torch.stack([read.query.detach().norm().cpu() for _, read in reads]),
            readers=[name for name, _ in reads],
            entries=self.memory_entry_names(),
        )


def _create_vit_qimia(variant: str, pretrained: bool = False, **kwargs) -> VisionTransformerQimia:
    out_indices = kwargs.pop('out_indices', 3)
    return build_model_with_cfg(
        VisionTransformerQimia,
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
        'paper_name': 'Query Integrated Memory Interfacing Attention (SURF Final Report, 2023)',
        **kwargs,
    }


def _cifar_cfg(**kwargs) -> Dict[str, Any]:
    return _cfg(num_classes=10, input_size=(3, 32, 32), crop_pct=1.0, mean=CIFAR10_MEAN, std=CIFAR10_STD, **kwargs)


# Only architectures for now: no tag points at weights until weights are published.
default_cfgs = generate_default_cfgs({
    'vit_qimia_tiny.untrained': _cifar_cfg(),
    'vit_qimia_small.untrained': _cifar_cfg(),
    'vit_qimia_base.untrained': _cifar_cfg(),
    'vit_qimia_surf23_patch8_32.untrained': _cifar_cfg(),
    'vit_qimia_tiny_patch16_224.untrained': _cfg(),
    'vit_qimia_small_patch16_224.untrained': _cfg(),
    'vit_qimia_base_patch16_224.untrained': _cfg(),
})

# ViT-Ti/S/B widths; keys a third of the width (the report found small keys train best), depth heads of 8 channels
_TINY = dict(embed_dim=192, depth=12, num_heads=3, key_dim=64)
_SMALL = dict(embed_dim=384, depth=12, num_heads=6, key_dim=128)
_BASE = dict(embed_dim=768, depth=12, num_heads=12, key_dim=256)


@register_model
def vit_qimia_tiny(pretrained: bool = False, **kwargs) -> VisionTransformerQimia:
    """QIMIA ViT-Ti (192 wide, 12 layers, 3 heads, keys 64 wide in 8 depth heads), patch 4 at 32 x 32."""
    model_args = dict(patch_size=4, **_TINY)
    return _create_vit_qimia('vit_qimia_tiny', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def vit_qimia_small(pretrained: bool = False, **kwargs) -> VisionTransformerQimia:
    """QIMIA ViT-S (384 wide, 12 layers, 6 heads, keys 128 wide in 16 depth heads), patch 4 at 32 x 32."""
    model_args = dict(patch_size=4, **_SMALL)
    return _create_vit_qimia('vit_qimia_small', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def vit_qimia_base(pretrained: bool = False, **kwargs) -> VisionTransformerQimia:
    """QIMIA ViT-B (768 wide, 12 layers, 12 heads, keys 256 wide in 32 depth heads), patch 4 at 32 x 32."""
    model_args = dict(patch_size=4, **_BASE)
    return _create_vit_qimia('vit_qimia_base', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def vit_qimia_surf23_patch8_32(pretrained: bool = False, **kwargs) -> VisionTransformerQimia:
    """The SURF report's CIFAR configuration (appendix): 256 wide, depth 10, patch 8, feed-forward 1024, keys 256
    wide in 32 depth heads, 8 token-attention heads (the authors' code), at 32 x 32."""
    model_args = dict(patch_size=8, embed_dim=256, depth=10, num_heads=8, mlp_ratio=4., key_dim=256)
    return _create_vit_qimia('vit_qimia_surf23_patch8_32', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def vit_qimia_tiny_patch16_224(pretrained: bool = False, **kwargs) -> VisionTransformerQimia:
    """QIMIA ViT-Ti/16 at 224 x 224."""
    model_args = dict(patch_size=16, **_TINY)
    return _create_vit_qimia('vit_qimia_tiny_patch16_224', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def vit_qimia_small_patch16_224(pretrained: bool = False, **kwargs) -> VisionTransformerQimia:
    """QIMIA ViT-S/16 at 224 x 224."""
    model_args = dict(patch_size=16, **_SMALL)
    return _create_vit_qimia('vit_qimia_small_patch16_224', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def vit_qimia_base_patch16_224(pretrained: bool = False, **kwargs) -> VisionTransformerQimia:
    """QIMIA ViT-B/16 at 224 x 224."""
    model_args = dict(patch_size=16, **_BASE)
    return _create_vit_qimia('vit_qimia_base_patch16_224', pretrained=pretrained, **dict(model_args, **kwargs))
