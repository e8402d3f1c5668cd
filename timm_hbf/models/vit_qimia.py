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
entries. The memory is a list of entries that blocks append to; what the backward pass keeps grows linearly with the
depth (see :mod:`timm_hbf.layers.depth_attention`). Queries start at zero: with the dot-product kernel every read
starts as the uniform average of the entries it sees (with the Gaussian kernel, see
:class:`~timm_hbf.layers.DepthAttention`). Report options:
``key_dim``, ``depth_num_heads``, ``key_norm``, ``value_norm='batchnorm'``, ``depth_kernel='gaussian'`` (L2
attention through the HyperBF kernel), path dropout (``drop_path_rate``), and a learned null entry. Beyond the
report: a block-memory mode (``memory_block_size``) that merges consecutive blocks' entries into summaries, so that
reads attend over a few summaries instead of every entry.
"""
import math
from typing import Any, Dict, List, Optional, Set, Tuple, Union

import torch
from timm.data import IMAGENET_INCEPTION_MEAN, IMAGENET_INCEPTION_STD
from timm.layers import Attention, PatchEmbed, resample_abs_pos_embed, trunc_normal_
from timm.models import build_model_with_cfg, checkpoint, generate_default_cfgs, named_apply, register_model
from timm.models._features import feature_take_indices
from timm.models.vision_transformer import checkpoint_filter_fn, init_weights_vit_timm
from torch import nn
from torch.jit import Final

from ..data import CIFAR10_MEAN, CIFAR10_STD
from ..layers import DepthAttention, DepthKey, PReLULinear, TokenBatchNorm, normalized_entropy
from ..layers.depth_attention import accumulation_dtype

__all__ = ['QimiaBlock', 'QimiaLayer', 'VisionTransformerQimia']

VALUE_NORMS = ('layernorm', 'batchnorm')
GLOBAL_POOLS = ('', 'token', 'avg')
# depth-attention queries (decay would pull every read back to the uniform average) and Gaussian widths
NO_DECAY_PARAM_NAMES = ('query', 'log_gamma')


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
        summary_position: Block-memory mode: this block's place in its memory block. Past the first, the block
            merges its entry into the memory block's summary (the last entry) instead of adding one: values summed
            (a residual stream within the memory block), keys averaged (a summary's logit is the mean of its
            members' logits, for either kernel), both in float32 or wider.
    """
    summary_position: Final[int]

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
            summary_position: int = 0,
            device=None,
            dtype=None,
    ) -> None:
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
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

    def entry(self, h: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The (key, value) entry that this block writes for the body's output ``h`` (a function of its own, so
        that ``h`` is freed as soon as both paths have read it)."""
        return self.key(h), self.value(h)

    def forward(
            self,
            key_entries: List[torch.Tensor],
            value_entries: List[torch.Tensor],
    ) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """Returns the entries that the next read sees: these with this block's entry appended, or merged into the
        last (block-memory mode). The lists passed in are left as they are."""
        key, value = self.entry(self.body(self.read(key_entries, value_entries)))
        if self.summary_position > 0:
            dtype = accumulation_dtype(value)  # summaries add up as reads accumulate, in float32 or wider
            key = torch.lerp(key_entries[-1].to(dtype), key.to(dtype), 1. / (self.summary_position + 1))
            value = value_entries[-1].to(dtype) + value
            key_entries, value_entries = key_entries[:-1], value_entries[:-1]
        return key_entries + [key], value_entries + [value]


class QimiaLayer(nn.Module):
    """One attention block and one feed-forward block, the QIMIA counterpart of a ViT block.
    ``summary_positions``: the blocks' places in their memory blocks (see :class:`QimiaBlock`)."""

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
        self.attn = QimiaBlock(attn, dim, summary_position=summary_positions[0], **memory_args)
        self.mlp = QimiaBlock(
            nn.Sequential(nn.Linear(dim, hidden, **dd), nn.Dropout(proj_drop)), hidden,
            summary_position=summary_positions[1], **memory_args,
        )

    def forward(
            self,
            key_entries: List[torch.Tensor],
            value_entries: List[torch.Tensor],
    ) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        key_entries, value_entries = self.attn(key_entries, value_entries)
        return self.mlp(key_entries, value_entries)


class VisionTransformerQimia(nn.Module):
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
            Under ``torch.compile`` choose 5: inductor adds a summary of up to four members inside every later read,
            which keeps the members alive (README, "Speed and memory").
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
    dynamic_img_size: Final[bool]

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
        if global_pool not in GLOBAL_POOLS:
            raise ValueError(f"Unknown global_pool '{global_pool}': use one of {GLOBAL_POOLS}.")
        if global_pool == 'token' and not class_token:
            raise ValueError("global_pool='token' needs class_token=True; use global_pool='avg' without a class token.")
        dd = {'device': device, 'dtype': dtype}
        depth_num_heads = depth_num_heads or max(key_dim // 8, 1)
        self.num_classes = num_classes
        self.global_pool = global_pool
        self.in_chans = in_chans
        self.embed_dim = self.num_features = self.head_hidden_size = embed_dim
        self.num_prefix_tokens = 1 if class_token else 0
        self.has_class_token = class_token
        self.dynamic_img_size = dynamic_img_size
        self.grad_checkpointing = False

        # stem: the patch embedding and the position embedding, two entries of the memory (report appendix)
        embed_args = dict(strict_img_size=False, output_fmt='NHWC') if dynamic_img_size else {}
        self.patch_embed = PatchEmbed(
            img_size=img_size,
            patch_size=patch_size,
            in_chans=in_chans,
            embed_dim=embed_dim,
            dynamic_img_pad=dynamic_img_pad,
            **embed_args,
            **dd,
        )
        num_patches = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.empty(1, 1, embed_dim, **dd)) if class_token else None
        self.pos_embed = nn.Parameter(torch.empty(1, num_patches + self.num_prefix_tokens, embed_dim, **dd))
        self.pos_drop = nn.Dropout(p=pos_drop_rate)
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
                depth_num_heads,
                mlp_ratio=mlp_ratio,
                qkv_bias=qkv_bias,
                depth_kernel=depth_kernel,
                key_norm=key_norm,
                value_norm=value_norm,
                proj_drop=proj_drop_rate,
                attn_drop=attn_drop_rate,
                path_drop=path_drop[i],
                summary_positions=((2 * i) % memory_block_size, (2 * i + 1) % memory_block_size),
                **dd,
            )
            for i in range(depth)
        ])
        # head (registered last: train.py's adaptive gradient clipping leaves out the last two parameters)
        patch = self.patch_embed.patch_size
        self.feature_info = [dict(module=f'blocks.{i}', num_chs=embed_dim, reduction=patch[0]) for i in range(depth)]
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6, **dd)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes, **dd) if num_classes > 0 else nn.Identity()
        self.init_weights(weight_init)

    def init_weights(self, mode: str = '') -> None:
        if mode not in ('', 'skip'):
            raise ValueError(f"Unknown weight_init '{mode}': use '' (ViT init) or 'skip'.")
        if mode == 'skip':
            return
        trunc_normal_(self.pos_embed, std=.02)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)
        if self.null_key is not None and self.null_value is not None:
            trunc_normal_(self.null_key, std=.02)
            nn.init.zeros_(self.null_value)
        named_apply(init_weights_vit_timm, self, include_root=False)  # Linears trunc-normal, else init_weights()

    # --- model API --------------------------------------------------------------------------------------------------

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        """Position embedding, class token, null entry, and every depth-attention query and Gaussian width: decay
        would pull reads back to the uniform average and widths to zero rather than regularise them."""
        no_decay = {n for n, _ in self.named_parameters() if n.rsplit('.', 1)[-1] in NO_DECAY_PARAM_NAMES}
        return {'pos_embed', 'cls_token', 'null_key', 'null_value'} | no_decay

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict:
        return dict(
            stem=r'^cls_token|pos_embed|patch_embed|patch_key|pos_key|patch_value_norm|pos_value_norm|null_',
            blocks=[(r'^blocks\.(\d+)', None), (r'^read_out|^norm', (99999,))],
        )

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        if global_pool is not None:
            if global_pool not in GLOBAL_POOLS:
                raise ValueError(f"Unknown global_pool '{global_pool}': use one of {GLOBAL_POOLS}.")
            self.global_pool = global_pool
        self.num_classes = num_classes
        param = next(self.parameters())
        self.head = nn.Linear(self.embed_dim, num_classes, device=param.device, dtype=param.dtype) \
            if num_classes > 0 else nn.Identity()
        self.head.train(self.training)

    @torch.jit.ignore
    def set_input_size(
            self,
            img_size: Optional[Union[int, Tuple[int, int]]] = None,
            patch_size: Optional[Union[int, Tuple[int, int]]] = None,
    ) -> None:
        """Change the input resolution (and patch size): the position embedding is resampled to the new grid."""
        prev_grid = self.patch_embed.grid_size
        self.patch_embed.set_input_size(img_size=img_size, patch_size=patch_size)
        if self.patch_embed.grid_size != prev_grid:
            requires_grad = self.pos_embed.requires_grad
            self.pos_embed = nn.Parameter(resample_abs_pos_embed(
                self.pos_embed.detach(),
                new_size=list(self.patch_embed.grid_size),
                old_size=list(prev_grid),
                num_prefix_tokens=self.num_prefix_tokens,
                verbose=True,
            ), requires_grad=requires_grad)
        for info in self.feature_info:
            info['reduction'] = self.patch_embed.patch_size[0]

    # --- memory -----------------------------------------------------------------------------------------------------

    @property
    def num_memory_entries(self) -> int:
        """Entries of a full forward pass: null entry (if any), patch and position embeddings, two per layer."""
        return self.num_stem_entries + 2 * len(self.blocks)

    def init_memory(self, x: torch.Tensor) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """Images to the stem's entries: ``(keys, values)``, the null entry (if any), then the patch embedding
        ``(B, N, .)`` and the position embedding (``(1, N, .)``, shared by the batch)."""
        tokens = self.patch_embed(x)
        pos_embed = self.pos_embed
        if self.dynamic_img_size:
            B, H, W, C = tokens.shape
            pos_embed = resample_abs_pos_embed(pos_embed, new_size=[H, W], num_prefix_tokens=self.num_prefix_tokens)
            tokens = tokens.view(B, -1, C)
        if self.cls_token is not None:  # in the tokens' dtype, so that the entry's dtype does not depend on it
            tokens = torch.cat([self.cls_token.expand(tokens.shape[0], -1, -1).to(tokens.dtype), tokens], dim=1)
        tokens = self.pos_drop(tokens)
        keys: List[torch.Tensor] = []
        values: List[torch.Tensor] = []
        if self.null_key is not None and self.null_value is not None:
            keys.append(self.key_format(self.null_key))
            values.append(self.null_value)
        keys.append(self.key_format(self.patch_key(tokens)))
        values.append(self.patch_value_norm(tokens))
        keys.append(self.key_format(self.pos_key(pos_embed)))
        values.append(self.pos_value_norm(pos_embed))
        return keys, values

    def _forward_taken(self, x: torch.Tensor, taken: List[int], last: int) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """Layers ``0..last``, then the output read: its result before the final norm, and the values that the
        feed-forward blocks of the ``taken`` layers wrote (a layer's output: there is no residual stream; in
        block-memory mode, the summary it was merged into)."""
        keys, values = self.init_memory(x)
        intermediates: List[torch.Tensor] = []
        for i, layer in enumerate(self.blocks):
            if i <= last:
                if self.grad_checkpointing and not torch.jit.is_scripting():
                    keys, values = checkpoint(layer, keys, values)
                else:
                    keys, values = layer(keys, values)
                if i in taken:
                    intermediates.append(values[-1])
        return self.read_out(keys, values), intermediates

    # --- forward ----------------------------------------------------------------------------------------------------

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x, _ = self._forward_taken(x, [], len(self.blocks) - 1)
        return self.norm(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        if self.global_pool == 'token':
            x = x[:, 0]
        elif self.global_pool == 'avg':
            x = x[:, self.num_prefix_tokens:].mean(dim=1)
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    @torch.jit.ignore
    def forward_intermediates(
            self,
            x: torch.Tensor,
            indices: Optional[Union[int, List[int]]] = None,
            return_prefix_tokens: bool = False,
            norm: bool = False,
            stop_early: bool = False,
            output_fmt: str = 'NCHW',
            intermediates_only: bool = False,
    ) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]]]:
        """Layer outputs (the values their feed-forward blocks wrote) along with (or instead of) the final features.

        Args:
            x: Images ``(B, C, H, W)``.
            indices: Last ``n`` layers if int, all if None, else the listed layer indices.
            return_prefix_tokens: Return ``(spatial, prefix)`` pairs instead of spatial tokens alone.
            norm: Apply the final norm to each intermediate.
            stop_early: Stop after the last layer that is asked for.
            output_fmt: ``'NCHW'`` feature maps or ``'NLC'`` token sequences.
            intermediates_only: Return only the intermediates.
        """
        if output_fmt not in ('NCHW', 'NLC'):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got '{output_fmt}'.")
        taken, max_index = feature_take_indices(len(self.blocks), indices)
        B, _, height, width = x.shape
        x, intermediates = self._forward_taken(x, taken, max_index if stop_early else len(self.blocks) - 1)
        if norm:
            intermediates = [self.norm(y) for y in intermediates]
        prefix = [y[:, :self.num_prefix_tokens] for y in intermediates]
        intermediates = [y[:, self.num_prefix_tokens:] for y in intermediates]
        if output_fmt == 'NCHW':
            H, W = self.patch_embed.dynamic_feat_size((height, width)) if self.dynamic_img_size \
                else self.patch_embed.grid_size
            intermediates = [y.reshape(B, H, W, -1).permute(0, 3, 1, 2).contiguous() for y in intermediates]
        if return_prefix_tokens and self.num_prefix_tokens:
            intermediates = list(zip(intermediates, prefix))
        if intermediates_only:
            return intermediates
        return self.norm(x), intermediates

    @torch.jit.ignore
    def prune_intermediate_layers(
            self,
            indices: Union[int, List[int]] = 1,
            prune_norm: bool = False,
            prune_head: bool = True,
    ) -> List[int]:
        """Drop the layers after the last index asked for (and the norm, the head); returns the kept indices."""
        taken, max_index = feature_take_indices(len(self.blocks), indices)
        self.blocks = self.blocks[:max_index + 1]
        self.feature_info = self.feature_info[:max_index + 1]
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.reset_classifier(0, '')
        return taken

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
        """Depth-attention diagnostics for a batch, in eval mode and without gradients (the model's mode is kept),
        all float32 on the CPU:

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
        readers, weights, seen = [], [], []  # seen: the columns of the entries that each read attends over
        try:
            with torch.no_grad():
                keys, values = self.init_memory(x)
                columns = list(range(self.num_stem_entries))
                for i, layer in enumerate(self.blocks):
                    for j, block in enumerate((layer.attn, layer.mlp)):
                        readers.append((f"{i}.{('attn', 'mlp')[j]}", block.read))
                        weights.append(block.read.weights(keys).float().cpu())
                        seen.append(list(columns))
                        keys, values = block(keys, values)
                        column = self.num_stem_entries + 2 * i + j
                        columns = columns[:-1] + [column] if block.summary_position > 0 else columns + [column]
                readers.append(('out', self.read_out))
                weights.append(self.read_out.weights(keys).float().cpu())
                seen.append(columns)
        finally:
            self.train(was_training)
        matrix = torch.full((len(weights), self.num_memory_entries), math.nan, dtype=torch.float32)
        for row, (w, cols) in enumerate(zip(weights, seen)):
            matrix[row, cols] = w.mean((1, 2, 3))
        return dict(
            matrix=matrix,
            entropy=torch.stack([normalized_entropy(w) for w in weights]),
            query_norm=torch.stack([read.query.detach().float().norm().cpu() for _, read in readers]),
            readers=[name for name, _ in readers],
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
