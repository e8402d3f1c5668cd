"""QIMIA Vision Transformer (Query Integrated Memory Interfacing Attention, Dugue, Caltech SURF report, 2023), and
Attention Residuals (AttnRes, Kimi Team, 2026) for vision.

No residual stream: every sublayer reads its input from a per-token memory of (key, value) entries through
learned-query attention over depth (report Eq. 1-2, :class:`~timm_hbf.layers.DepthAttention`) and writes one entry:

    memory:    (patch embedding), (position embedding)                 two separate entries (report appendix)
    sublayer:  A = sum_i softmax_i(s(q, k_i)) v_i                       over the entries written so far
               h = Attention(LN(A))   or   h = Linear(LN(A))            attention / feed-forward block
               k = Linear(PReLU(h)),  v = Linear(PReLU(h))              separate key and value paths
    output:    a last read over every entry, then LayerNorm, pooling and a linear head (timm's conventions)

LN is LayerNorm without affine (report appendix). A layer of ``depth`` is an attention and a feed-forward block, as
in a ViT, so ``depth`` 12 writes 24 entries. AttnRes is the same read with a few differences, each a flag of
:class:`VisionTransformerQimia` that works alone (its layers :class:`AttnResBlock`, timm's ViT block, with
``sublayer_values``); ``vit_attnres.py`` registers the AttnRes models.
"""
import re
from functools import partial
from typing import Any, Dict, List, Optional, Set, Tuple, Union

import torch
import torch.fx
from timm.layers import (
    Attention,
    AttentionPoolLatent,
    AttentionPoolPrr,
    LayerNorm,
    PatchEmbed,
    global_pool_nlc,
    resample_abs_pos_embed,
    resample_patch_embed,
    trunc_normal_,
)
from timm.models import checkpoint, generate_default_cfgs, named_apply, register_model
from timm.models._features import feature_take_indices
from timm.models.vision_transformer import init_weights_vit_timm
from torch import nn
from torch.jit import Final

from .._checks import check_choice, check_count, check_divisor, check_positive, check_vit_arguments, fail
from ..layers import (
    DEPTH_KERNELS,
    AttnResBlock,
    DepthAttention,
    DepthMemory,
    PReLULinear,
    TokenBatchNorm,
)
from ..layers.hyperbf_attention import check_one_mask
from ._builder import build_vit, cifar10_weights, vit_cfg

try:  # how timm's ViT records a resize, which save_for_hf and push_to_hf_hub write to config.json (not public API)
    from timm.models._input import update_model_input_size
except ImportError:  # a timm that moved it: no record, the resize still works
    update_model_input_size = None

__all__ = ['QimiaBlock', 'QimiaLayer', 'VisionTransformerQimia', 'checkpoint_filter_fn',
           'create_vit_qimia']

VALUE_NORMS = ('layernorm', 'batchnorm')
GLOBAL_POOLS = ('', 'token', 'avg', 'avgmax', 'max', 'map', 'prr')  # timm's ViT's
ATTENTION_POOLS = ('map', 'prr')
torch.fx.wrap('check_one_mask')  # a leaf for torch.fx: a symbolic trace cannot branch on its arguments
# depth-attention queries (decay would pull every read back to the uniform average) and Gaussian widths
NO_DECAY_PARAM_NAMES = ('query', 'log_gamma')


class QimiaBlock(nn.Module):
    """A QIMIA sublayer (report Fig. 8-9): ``x = read(memory)``, ``h = body(norm(x))`` (timm's ``Attention``, or the
    feed-forward block's Linear), then the write of ``key(h)`` (None: keys from values) and ``value(h)``."""
    attends: Final[bool]

    def __init__(self, read: DepthAttention, norm: nn.Module, body: nn.Module, key: Optional[nn.Module],
                 value: nn.Module) -> None:
        super().__init__()
        self.attends = isinstance(body, Attention)  # takes timm's attention mask
        self.read = read
        self.norm = norm
        self.body = body
        self.key = key
        self.value = value

    def forward(
            self,
            memory: DepthMemory,
            attn_mask: Optional[torch.Tensor] = None,
            is_causal: bool = False,
    ) -> DepthMemory:
        """The memory with this sublayer's entry written; ``attn_mask`` and ``is_causal`` go to the token attention,
        as timm's ``Attention`` takes them (a read over depth is per token: it needs no mask)."""
        x, memory = self.read(memory)
        x = self.norm(x)
        h = self.body(x, attn_mask=attn_mask, is_causal=is_causal) if self.attends else self.body(x)
        return self.read.write(memory, None if self.key is None else self.key(h), self.value(h))


class QimiaLayer(nn.Module):
    """An attention block and a feed-forward block: the QIMIA counterpart of a ViT block."""

    def __init__(self, attn: QimiaBlock, mlp: QimiaBlock) -> None:
        super().__init__()
        self.attn = attn
        self.mlp = mlp

    def memory_queries(self) -> List[torch.Tensor]:
        """The queries of its reads, in reading order."""
        return self.attn.read.memory_queries() + self.mlp.read.memory_queries()

    def forward(
            self,
            memory: DepthMemory,
            attn_mask: Optional[torch.Tensor] = None,
            is_causal: bool = False,
    ) -> DepthMemory:
        return self.mlp(self.attn(memory, attn_mask=attn_mask, is_causal=is_causal))


def _flatten(memory: DepthMemory) -> Tuple[torch.Tensor, ...]:
    """The memory as a flat tuple: reentrant gradient checkpointing (``timm.layers.set_reentrant_ckpt(True)``) tracks
    no tensors in lists."""
    return (memory.queries, memory.key, memory.value, *memory.values, *[t for read in memory.logits for t in read])


def _unflatten(flat: Tuple[torch.Tensor, ...]) -> DepthMemory:
    """The memory of a :func:`_flatten` tuple: ``L`` values, then ``L`` logits for each of ``R`` reads."""
    queries, key, value, *rest = flat
    num = len(rest) // (queries.shape[-1] + 1)
    logits = [rest[num * (r + 1):num * (r + 2)] for r in range(queries.shape[-1])]
    return DepthMemory(queries, rest[:num], logits, key, value)


def _layer_flat(layer: nn.Module, attn_mask: Optional[torch.Tensor], is_causal: bool, *memory: torch.Tensor):
    """``layer`` on a flat memory, for gradient checkpointing."""
    return _flatten(layer(_unflatten(memory), attn_mask=attn_mask, is_causal=is_causal))


def _check_arguments(args: Dict[str, Any]) -> None:
    """What the model would otherwise build wrong without a word, or fail on deep inside."""
    check_vit_arguments(args)
    check_count('memory_block_size', args['memory_block_size'])
    for name in ('key_dim', 'depth_num_heads'):
        if args[name] is not None:
            check_count(name, args[name])
    embed_dim, key_dim = args['embed_dim'], args['key_dim']
    if int(args['mlp_ratio'] * embed_dim) < 1:
        fail('mlp_ratio', args['mlp_ratio'], f'a number with int(embed_dim * mlp_ratio) >= 1 (embed_dim {embed_dim})')
    for name, choices in (('global_pool', GLOBAL_POOLS), ('depth_kernel', DEPTH_KERNELS),
                          ('value_norm', VALUE_NORMS), ('weight_init', ('', 'skip'))):
        check_choice(name, args[name], choices)
    check_divisor('num_heads', args['num_heads'], 'embed_dim', embed_dim)
    if args['global_pool'] == 'token' and not args['class_token']:
        fail('global_pool', 'token', f"one of {GLOBAL_POOLS[2:]} without a class token (class_token=False)")
    if args['keys_from_values'] and key_dim not in (None, embed_dim):
        fail('key_dim', key_dim, f'None or embed_dim ({embed_dim}) with keys_from_values: the keys are the values')
    if args['keys_from_values'] and args['key_norm']:
        fail('key_norm', True, 'False with keys_from_values, whose keys are RMS-normalised already')
    if args['init_values'] is not None:
        check_positive('init_values', args['init_values'])
    for name in ('no_embed_class', 'pre_norm', 'init_values'):
        if args[name] and not args['sublayer_values']:
            fail(name, args[name], f"{'None' if name == 'init_values' else 'False'} without sublayer_values (timm's "
                 'ViT blocks): QIMIA has no residual branch to scale, and its position embedding is an entry')


class VisionTransformerQimia(nn.Module):
    """Vision Transformer whose sublayers read a memory of all earlier outputs instead of a residual stream.

    Args:
        img_size, patch_size, in_chans, num_classes, embed_dim, num_heads, mlp_ratio, qkv_bias, qk_norm, class_token,
        reg_tokens, dynamic_img_size, dynamic_img_pad, drop_rate, attn_drop_rate, proj_drop_rate: As in timm's ViT.
        no_embed_class, pre_norm, init_values: As in timm's ViT (position embedding of the patches alone, LayerNorm
            on the token embedding, layer scale), with ``sublayer_values``: AttnRes on timm ViT weights.
        global_pool: timm's ViT's poolings: ``'token'``, ``'avg'``, ``'max'``, ``'avgmax'``, ``'map'``, ``'prr'``,
            ``''``.
        depth: Number of layers, each an attention and a feed-forward sublayer.
        key_dim: Width of the memory keys and queries (default ``embed_dim // 3``, the report found small keys train
            best; ``embed_dim`` with ``keys_from_values``).
        depth_num_heads: Depth-attention heads, splitting keys and values (default ``key_dim // 8``, as the report).
        depth_kernel: ``'dot'`` (report Eq. 1) or ``'gaussian'`` (the report's L2 attention, HyperBF kernel).
        key_norm: Unit-L2 keys per head (the report's key normalisation).
        keys_from_values: AttnRes's keys: every entry's key is its value, RMS-normalised per head.
        sublayer_values: AttnRes's values: timm's ViT blocks (:class:`AttnResBlock`) whose sublayers write their
            outputs; the token embedding (patch + position) is one entry, which the first sublayer takes as it is.
        value_norm: ``'layernorm'`` (LayerNorm on every read) or ``'batchnorm'`` (BatchNorm on every written value,
            and no LayerNorm on reads unless ``sublayer_values``).
        null_entry: A learned (key, value) entry that every read can attend to, to read (almost) nothing.
        memory_block_size: Block memory (Block AttnRes): the entries of every ``memory_block_size`` consecutive
            sublayers merge into one summary, values summed; reads attend over the stem's entries, the finished
            summaries and the current one. 1 keeps every entry.
        pos_drop_rate: Dropout on the patch-embedding entry with its class and register tokens (the token embedding
            with ``sublayer_values``).
        drop_path_rate: Path dropout: dropout on the depth-attention weights (report §6), growing linearly to this
            rate in the last layer.
        weight_init: ``''`` for the ViT init (queries zero), ``'skip'`` to leave parameters uninitialised.
    """
    dynamic_img_size: Final[bool]
    sublayer_values: Final[bool]
    no_embed_class: Final[bool]

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
            qk_norm: bool = False,
            key_dim: Optional[int] = None,
            depth_num_heads: Optional[int] = None,
            depth_kernel: str = 'dot',
            key_norm: bool = False,
            keys_from_values: bool = False,
            sublayer_values: bool = False,
            value_norm: str = 'layernorm',
            null_entry: bool = False,
            memory_block_size: int = 1,
            class_token: bool = True,
            reg_tokens: int = 0,
            no_embed_class: bool = False,
            pre_norm: bool = False,
            init_values: Optional[float] = None,
            dynamic_img_size: bool = False,
            dynamic_img_pad: bool = False,
            drop_rate: float = 0.,
            pos_drop_rate: float = 0.,
            proj_drop_rate: float = 0.,
            attn_drop_rate: float = 0.,
            drop_path_rate: float = 0.,
            weight_init: str = '',
            device: torch.types.Device = None,
            dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        _check_arguments(locals())
        key_dim = key_dim or (embed_dim if keys_from_values else max(embed_dim // 3, 1))
        heads = depth_num_heads or max(key_dim // 8, 1)
        if key_dim % heads or embed_dim % heads:
            fail('depth_num_heads', heads, f'a common divisor of key_dim ({key_dim}) and embed_dim ({embed_dim})'
                                           f'{"" if depth_num_heads else " (the default is key_dim // 8)"}')
        dd = {'device': device, 'dtype': dtype}
        self.num_classes = num_classes
        self.global_pool = global_pool
        self.in_chans = in_chans
        self.embed_dim = self.num_features = self.head_hidden_size = embed_dim
        self.num_heads, self.mlp_ratio = num_heads, mlp_ratio
        self.num_reg_tokens = reg_tokens
        self.num_prefix_tokens = (1 if class_token else 0) + reg_tokens
        self.has_class_token = class_token
        self.no_embed_class = no_embed_class
        self.dynamic_img_size = dynamic_img_size
        self.sublayer_values = sublayer_values
        self.memory_block_size = memory_block_size
        self.grad_checkpointing = False

        # the stem: the patch and the position embeddings (or their sum, the token embedding), entries of the memory
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
        self.reg_token = nn.Parameter(torch.empty(1, reg_tokens, embed_dim, **dd)) if reg_tokens else None
        num_positions = num_patches + (0 if no_embed_class else self.num_prefix_tokens)
        self.pos_embed = nn.Parameter(torch.empty(1, num_positions, embed_dim, **dd))
        self.pos_drop = nn.Dropout(p=pos_drop_rate)
        self.norm_pre = nn.LayerNorm(embed_dim, eps=1e-6, **dd) if pre_norm else nn.Identity()

        # AttnRes: keys_from_values, sublayer_values (AttnResBlock, the token embedding one entry), one depth head
        learned_keys = not keys_from_values
        batchnorm = value_norm == 'batchnorm'
        read = partial(DepthAttention, key_dim, heads, kernel=depth_kernel,
                       key_norm='rms' if keys_from_values else 'l2' if key_norm else '', **dd)
        stem_entries = int(null_entry) + (1 if sublayer_values else 2)
        num_sublayers = 2 * depth

        def depth_read(index: int) -> DepthAttention:
            """Sublayer ``index``'s read (2 per layer, ``num_sublayers`` the output read's); path dropout grows
            linearly with depth, as drop path does; a read over a single entry is no read."""
            path_drop = drop_path_rate * (index // 2) / max(depth - 1, 1) if index < num_sublayers else 0.
            return read(path_drop=path_drop, query=index > 0 or stem_entries > 1,
                        position=index % memory_block_size, block_size=memory_block_size)

        self.read_out = depth_read(num_sublayers)  # merges an unfinished block
        self.patch_key = nn.Linear(embed_dim, key_dim, **dd) if learned_keys else None
        self.pos_key = nn.Linear(embed_dim, key_dim, **dd) if learned_keys and not sublayer_values else None
        self.patch_value_norm = TokenBatchNorm(embed_dim, **dd) if batchnorm else nn.Identity()
        self.pos_value_norm = TokenBatchNorm(embed_dim, **dd) if batchnorm and not sublayer_values else nn.Identity()
        self.null_key = nn.Parameter(torch.empty(key_dim, **dd)) if null_entry else None
        self.null_value = nn.Parameter(torch.empty(embed_dim, **dd)) if null_entry else None

        def qimia_sublayer(index: int, body: nn.Module, body_dim: int) -> QimiaBlock:
            """Sublayer ``index``: its read, norm, key and value paths around ``body``."""
            value = PReLULinear(body_dim, embed_dim, **dd)
            return QimiaBlock(
                depth_read(index),
                nn.Identity() if batchnorm else nn.LayerNorm(embed_dim, eps=1e-6, elementwise_affine=False, **dd),
                body,
                PReLULinear(body_dim, key_dim, **dd) if learned_keys else None,
                nn.Sequential(value, TokenBatchNorm(embed_dim, **dd)) if batchnorm else value,
            )

        hidden = int(embed_dim * mlp_ratio)
        self.blocks = nn.ModuleList([  # layers take and return the memory, so not a Sequential
            AttnResBlock(embed_dim, num_heads, depth_read(2 * i), depth_read(2 * i + 1), mlp_ratio=mlp_ratio,
                         qkv_bias=qkv_bias, qk_norm=qk_norm, proj_drop=proj_drop_rate, attn_drop=attn_drop_rate,
                         init_values=init_values, key_dim=key_dim if learned_keys else None, batchnorm=batchnorm, **dd)
            if sublayer_values else QimiaLayer(
                qimia_sublayer(2 * i, Attention(embed_dim, num_heads=num_heads, qkv_bias=qkv_bias, qk_norm=qk_norm,
                                                attn_drop=attn_drop_rate, proj_drop=proj_drop_rate,
                                                norm_layer=LayerNorm, **dd), embed_dim),
                qimia_sublayer(2 * i + 1, nn.Sequential(nn.Linear(embed_dim, hidden, **dd),
                                                        nn.Dropout(proj_drop_rate)), hidden),
            )
            for i in range(depth)
        ])
        patch = self.patch_embed.patch_size
        self.feature_info = [dict(module=f'blocks.{i}', num_chs=embed_dim, reduction=patch[0]) for i in range(depth)]
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6 if sublayer_values or batchnorm else 1e-12, **dd)
        self.attn_pool = self._attention_pool(global_pool) if global_pool in ATTENTION_POOLS else None
        # head (registered last: train.py's adaptive gradient clipping leaves out the last two parameters)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes, **dd) if num_classes > 0 else nn.Identity()
        self.init_weights(weight_init)
        self.register_load_state_dict_pre_hook(_zero_queries)

    def _attention_pool(self, kind: str) -> nn.Module:
        """timm's attention pooling ``kind``, as timm's ViT builds it: ``'map'``, attention with a learned latent
        query (over the patch tokens); ``'prr'``, parameter-free self-attention (over every token) before taking the
        class token, or the mean without one."""
        dd = dict(device=self.pos_embed.device, dtype=self.pos_embed.dtype)
        if kind == 'prr':
            return AttentionPoolPrr(self.embed_dim, num_heads=self.num_heads,
                                    pool_type='token' if self.has_class_token else 'avg', **dd)
        return AttentionPoolLatent(self.embed_dim, num_heads=self.num_heads, mlp_ratio=self.mlp_ratio,
                                   norm_layer=partial(nn.LayerNorm, eps=1e-6), **dd)

    def init_weights(self, mode: str = '') -> None:
        if mode == 'skip':
            return
        trunc_normal_(self.pos_embed, std=.02)
        if self.cls_token is not None:  # an entry of its own (unless sublayer_values) starts at a patch entry's scale:
            # near zero, as in timm's ViT, its unit-L2 key would scale the key path's gradients by 1 / |k|
            nn.init.normal_(self.cls_token, std=1e-6 if self.sublayer_values else .02)
        if self.reg_token is not None:
            nn.init.normal_(self.reg_token, std=1e-6)
        if self.null_key is not None:  # keys_from_values: unit RMS, as the normalised keys beside it
            trunc_normal_(self.null_key, std=1. if self.patch_key is None else .02)
        if self.null_value is not None:  # unit scale: the LayerNorm after a read of it alone stays well conditioned
            nn.init.normal_(self.null_value)
        named_apply(init_weights_vit_timm, self, include_root=False)  # Linears trunc-normal, else init_weights()

    # --- model API --------------------------------------------------------------------------------------------------

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        """Position embedding, class and register tokens, null entry, and every depth-attention query and Gaussian
        width: decay would pull reads back to the uniform average and widths to zero rather than regularise them."""
        no_decay = {n for n, _ in self.named_parameters() if n.rsplit('.', 1)[-1] in NO_DECAY_PARAM_NAMES}
        return {'pos_embed', 'cls_token', 'reg_token', 'null_key', 'null_value'} | no_decay

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict:
        return dict(
            stem=r'^cls_token|reg_token|pos_embed|patch_embed|norm_pre|patch_key|pos_key|patch_value_norm|pos_value_norm'
                 r'|null_',
            blocks=[(r'^blocks\.(\d+)', None), (r'^read_out|^norm', (99999,))],
        )

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        check_count('num_classes', num_classes, low=0)
        if global_pool is not None:
            if global_pool not in GLOBAL_POOLS or global_pool == 'token' and not self.has_class_token:
                fail('global_pool', global_pool, f"one of {GLOBAL_POOLS} ('token' with a class token)")
            if global_pool not in ATTENTION_POOLS:
                self.attn_pool = None
            elif self.attn_pool is None or global_pool != self.global_pool:
                self.attn_pool = self._attention_pool(global_pool).train(self.training)
            self.global_pool = global_pool
        self.num_classes = num_classes
        param = self.pos_embed
        self.head = nn.Linear(self.embed_dim, num_classes, device=param.device, dtype=param.dtype) \
            if num_classes > 0 else nn.Identity()
        self.head.train(self.training)

    @torch.jit.ignore
    def set_input_size(
            self,
            img_size: Optional[Union[int, Tuple[int, int]]] = None,
            patch_size: Optional[Union[int, Tuple[int, int]]] = None,
    ) -> None:
        """Change the input resolution (and patch size): the position embedding is resampled to the new grid, and the
        model records its new size as timm's ViT does (what ``save_for_hf`` writes to ``config.json``)."""
        prev_grid = self.patch_embed.grid_size
        self.patch_embed.set_input_size(img_size=img_size, patch_size=patch_size)
        if self.patch_embed.grid_size != prev_grid:
            requires_grad = self.pos_embed.requires_grad
            self.pos_embed = nn.Parameter(resample_abs_pos_embed(
                self.pos_embed.detach(),
                new_size=list(self.patch_embed.grid_size),
                old_size=list(prev_grid),
                num_prefix_tokens=self._embedded_prefix(),
                verbose=True,
            ), requires_grad=requires_grad)
        for info in self.feature_info:
            info['reduction'] = self.patch_embed.patch_size[0]
        if update_model_input_size is not None:
            update_model_input_size(self, self.patch_embed.img_size, patch_size=patch_size)

    # --- forward ----------------------------------------------------------------------------------------------------

    def _embedded_prefix(self) -> int:
        """The prefix tokens that the position embedding has positions for."""
        return 0 if self.no_embed_class else self.num_prefix_tokens

    def depth_queries(self) -> List[torch.Tensor]:
        """Every read's query as the memory uses it, ``(H, Dk', 1)`` each, in reading order (the output read's last)."""
        queries: List[torch.Tensor] = []
        for layer in self.blocks:
            queries += layer.memory_queries()
        queries.append(self.read_out.memory_query())
        return queries

    def embed(self, x: torch.Tensor) -> List[Tuple[Optional[torch.Tensor], torch.Tensor]]:
        """Images to the stem's entries, ``(key, value)`` before the memory normalises the key (None: from the
        value): the null entry (if any), then the patch embedding ``(B, N, D)`` and the position embedding
        ``(1, N, D)``, shared by the batch, or with ``sublayer_values`` the token embedding, their sum."""
        tokens = self.patch_embed(x)
        pos_embed = self.pos_embed
        if self.dynamic_img_size:
            B, H, W, C = tokens.shape
            pos_embed = resample_abs_pos_embed(pos_embed, new_size=[H, W], old_size=self.patch_embed.grid_size,
                                               num_prefix_tokens=self._embedded_prefix())
            tokens = tokens.view(B, -1, C)
        if self.no_embed_class:  # positions for the patches alone, as timm's ViT
            tokens = tokens + pos_embed
        prefix: List[torch.Tensor] = []  # in the tokens' dtype, so that the entry's dtype does not depend on them
        if self.cls_token is not None:
            prefix.append(self.cls_token.expand(tokens.shape[0], -1, -1).to(tokens.dtype))
        if self.reg_token is not None:
            prefix.append(self.reg_token.expand(tokens.shape[0], -1, -1).to(tokens.dtype))
        if len(prefix) > 0:
            tokens = torch.cat(prefix + [tokens], dim=1)
        if self.sublayer_values and not self.no_embed_class:
            tokens = tokens + pos_embed
        tokens = self.norm_pre(self.pos_drop(tokens))
        entries: List[Tuple[Optional[torch.Tensor], torch.Tensor]] = []
        if self.null_key is not None and self.null_value is not None:
            entries.append((self.null_key, self.null_value))
        entries.append((None if self.patch_key is None else self.patch_key(tokens), self.patch_value_norm(tokens)))
        if not self.sublayer_values:
            entries.append((None if self.pos_key is None else self.pos_key(pos_embed), self.pos_value_norm(pos_embed)))
        return entries

    def init_memory(self, x: torch.Tensor) -> DepthMemory:
        """The memory holding the stem's entries, for every read of the model."""
        entries = self.embed(x)
        read = self.read_out
        memory = read.start(self.depth_queries())
        tokens = entries[-1 if self.sublayer_values else -2][1]  # the one entry of every token and image
        for key, value in entries:
            memory = read.store(memory, read.key(value if key is None else key), value, tokens)
        return memory

    def _stopped_early(self, memory: DepthMemory, last: int) -> DepthMemory:
        """The memory after layer ``last`` as the output read of a model of ``last + 1`` layers sees it: the output
        read's logits alone, and a memory block that those layers leave unfinished as a running summary where the
        output read merges one, else stored."""
        queries, values, logits = memory.queries[..., -1:], memory.values, memory.logits[-1:]
        unfinished = 2 * (last + 1) % self.memory_block_size > 0
        if unfinished and self.read_out.position == 0:
            return self.read_out.store(DepthMemory(queries, values, logits, memory.key, memory.value), memory.key,
                                       memory.value)
        if not unfinished and self.read_out.position > 0:  # the newest entry, as the summary it merges
            return DepthMemory(queries, values[:-1], [logits[0][:-1]], memory.key, memory.value)
        return DepthMemory(queries, values, logits, memory.key, memory.value)

    def _forward_taken(
            self,
            x: torch.Tensor,
            taken: List[int],
            last: int,
            attn_mask: Optional[torch.Tensor] = None,
            is_causal: bool = False,
    ) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """Layers ``0..last``, then the output read: its result before the final norm, and the values that the
        feed-forward blocks of the ``taken`` layers wrote (a layer's output: there is no residual stream; in
        block-memory mode, the summary it was merged into). ``attn_mask`` and ``is_causal``: as timm's ViT takes
        them, for every token attention (not both at once)."""
        check_one_mask(attn_mask, is_causal)
        memory = self.init_memory(x)
        intermediates: List[torch.Tensor] = []
        for i, layer in enumerate(self.blocks):
            if i <= last:
                if self.grad_checkpointing and not torch.jit.is_scripting():
                    flat = checkpoint(partial(_layer_flat, layer, attn_mask, is_causal), *_flatten(memory))
                    memory = _unflatten(flat)
                else:
                    memory = layer(memory, attn_mask=attn_mask, is_causal=is_causal)
                if i in taken:
                    intermediates.append(memory.value)
        if last < len(self.blocks) - 1:
            memory = self._stopped_early(memory, last)
        out, _ = self.read_out(memory)
        return out, intermediates

    def forward_features(
            self,
            x: torch.Tensor,
            attn_mask: Optional[torch.Tensor] = None,
            is_causal: bool = False,
    ) -> torch.Tensor:
        x, _ = self._forward_taken(x, [], len(self.blocks) - 1, attn_mask=attn_mask, is_causal=is_causal)
        return self.norm(x)

    def pool(self, x: torch.Tensor, pool_type: Optional[str] = None) -> torch.Tensor:
        """Tokens ``(B, N, C)`` pooled as timm's ViT pools them: by the attention pool if the model has one, else
        by ``pool_type`` (default ``global_pool``)."""
        if self.attn_pool is not None:
            return self.attn_pool(x if self.global_pool == 'prr' else x[:, self.num_prefix_tokens:])
        pool_type = self.global_pool if pool_type is None else pool_type
        return global_pool_nlc(x, pool_type=pool_type, num_prefix_tokens=self.num_prefix_tokens)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.head_drop(self.pool(x))
        return x if pre_logits else self.head(x)

    def forward(
            self,
            x: torch.Tensor,
            attn_mask: Optional[torch.Tensor] = None,
            is_causal: bool = False,
    ) -> torch.Tensor:
        return self.forward_head(self.forward_features(x, attn_mask=attn_mask, is_causal=is_causal))

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
            output_dict: bool = False,
            attn_mask: Optional[torch.Tensor] = None,
            is_causal: bool = False,
    ) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]], Dict[str, Any]]:
        """Layer outputs (the values their feed-forward sublayers wrote) along with (or instead of) the final
        features, with the arguments and results of timm's ViT (``indices``, ``norm``, ``stop_early``, ``output_fmt``
        ``'NCHW'`` or ``'NLC'``, ``output_dict``, ...); ``attn_mask`` and ``is_causal`` (not both) as ``forward``."""
        if output_fmt not in ('NCHW', 'NLC'):
            fail('output_fmt', output_fmt, "'NCHW' or 'NLC'")
        taken, max_index = feature_take_indices(len(self.blocks), indices)
        B, _, height, width = x.shape
        x, intermediates = self._forward_taken(x, taken, max_index if stop_early else len(self.blocks) - 1,
                                               attn_mask=attn_mask, is_causal=is_causal)
        if norm:
            intermediates = [self.norm(y) for y in intermediates]
        prefix = [y[:, :self.num_prefix_tokens] for y in intermediates]
        intermediates = [y[:, self.num_prefix_tokens:] for y in intermediates]
        if output_fmt == 'NCHW':
            H, W = self.patch_embed.dynamic_feat_size((height, width)) if self.dynamic_img_size \
                else self.patch_embed.grid_size
            intermediates = [y.reshape(B, H, W, -1).permute(0, 3, 1, 2).contiguous() for y in intermediates]
        if output_dict:
            out: Dict[str, Any] = dict(image_intermediates=intermediates)
            if return_prefix_tokens and self.num_prefix_tokens:
                out['image_intermediates_prefix'] = prefix
            if not intermediates_only:
                out['image_features'] = self.norm(x)
            return out
        if return_prefix_tokens and self.num_prefix_tokens:
            intermediates = list(zip(intermediates, prefix))
        if intermediates_only:
            return intermediates
        return self.norm(x), intermediates

    @torch.jit.ignore
    def get_intermediate_layers(
            self,
            x: torch.Tensor,
            n: Union[int, List[int], Tuple[int, ...]] = 1,
            reshape: bool = False,
            return_prefix_tokens: bool = False,
            norm: bool = False,
            attn_mask: Optional[torch.Tensor] = None,
    ) -> List[Any]:
        """The DINO interface of timm's ViT: the outputs of the last ``n`` layers (or of the layers ``n`` lists),
        token sequences ``(B, HW, C)``, or maps ``(B, C, H, W)`` with ``reshape``."""
        return self.forward_intermediates(x, n, return_prefix_tokens=return_prefix_tokens, norm=norm,
                                          output_fmt='NCHW' if reshape else 'NLC', intermediates_only=True,
                                          attn_mask=attn_mask)

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
        self.read_out.position = 2 * len(self.blocks) % self.memory_block_size  # merges an unfinished block
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.reset_classifier(0, '')
        return taken


def _zero_queries(model: VisionTransformerQimia, state_dict: Dict[str, Any], prefix: str = '', *args: Any) -> None:
    """A timm ViT's weights (no queries at all) for AttnRes: zero queries added, reads that start uniform. A load
    pre-hook, so that ``load_state_dict`` and timm's ``load_checkpoint`` take them too."""
    if model.sublayer_values and f'{prefix}blocks.0.norm1.weight' in state_dict \
            and not any(k.startswith(prefix) and k.endswith('.query') for k in state_dict):
        queries = {prefix + k: torch.zeros_like(p) for k, p in model.named_parameters() if k.endswith('.query')}
        state_dict.update(queries)


_ATTNRES_NAMES = dict(read='read{}', norm='norm{}', key='key{}', value='value_norm{}')


def _current_name(name: str, attnres: bool) -> str:
    """A parameter's name in this release: timm_hbf 0.1 wrapped key and value paths in a Sequential (``key.0.``), and
    up to 0.2 AttnRes's sublayers were QIMIA's (``blocks.N.attn.body.qkv`` is now ``blocks.N.attn.qkv``, as in timm's
    ViT; ``.read``, ``.norm``, ``.key``, ``.value`` of the attention and feed-forward sublayers now end in 1 and 2)."""
    name = re.sub(r'\.(key|value)\.0\.', r'.\1.', name)
    match = re.match(r'(blocks\.\d+)\.(attn|mlp)\.(read|norm|body|key|value)\.(.*)', name) if attnres else None
    if match is None:
        return name
    block, sublayer, part, rest = match.groups()
    part = sublayer if part == 'body' else _ATTNRES_NAMES[part].format(1 if sublayer == 'attn' else 2)
    return f'{block}.{part}.{rest}'


def checkpoint_filter_fn(state_dict: Dict[str, torch.Tensor], model: VisionTransformerQimia) -> Dict[str, torch.Tensor]:
    """A checkpoint for ``model``: the position embedding resampled to its grid, the patch embedding to its patch size,
    and the keys of timm_hbf 0.1 mapped: the key and value paths of one layer were wrapped in a Sequential
    (``key.0.``), a first read over a single entry had a query (which no weights could train: dropped), and the null
    entry under ``keys_from_values`` had the normalised null value as its key (now a learned key, set to that value).

    A timm ``VisionTransformer``'s weights load into AttnRes with zero queries: every read the uniform average of its
    entries, the residual stream over their count, whose scale the LayerNorm after it removes, so that the model
    computes the ViT's function. The checkpoint's grid is its pretrained cfg's image size over its patch size where
    that accounts for every position (so weights of a 8 x 8 grid resample to a model of 16 x 4), else square."""
    expected = model.state_dict()
    state_dict = {k if k in expected else _current_name(k, model.sublayer_values): v for k, v in state_dict.items()}
    for name in ('blocks.0.attn.read.query', 'blocks.0.attn.read.kernel.log_gamma', 'blocks.0.read1.query',
                 'blocks.0.read1.kernel.log_gamma'):
        if name not in expected:
            state_dict.pop(name, None)
    if 'null_key' in expected and 'null_key' not in state_dict and 'null_value' in state_dict \
            and model.patch_key is None:
        state_dict['null_key'] = state_dict['null_value']
    _zero_queries(model, state_dict)
    pos_embed, patch = state_dict.get('pos_embed'), state_dict.get('patch_embed.proj.weight')
    grid = tuple(model.patch_embed.grid_size)
    if pos_embed is not None:
        old_grid = None
        trained_size = (getattr(model, 'pretrained_cfg', None) or {}).get('input_size')
        if trained_size is not None and patch is not None and patch.ndim == 4:
            old_grid = tuple(size // step for size, step in zip(trained_size[-2:], patch.shape[-2:]))
            if old_grid[0] * old_grid[1] != pos_embed.shape[1] - model._embedded_prefix():
                old_grid = None
        if pos_embed.shape != model.pos_embed.shape or old_grid not in (None, grid):
            state_dict['pos_embed'] = resample_abs_pos_embed(
                pos_embed, new_size=list(grid), old_size=old_grid and list(old_grid),
                num_prefix_tokens=model._embedded_prefix(), verbose=True)
    if patch is not None and patch.shape[-2:] != model.patch_embed.proj.weight.shape[-2:]:
        state_dict['patch_embed.proj.weight'] = resample_patch_embed(patch, list(model.patch_embed.patch_size),
                                                                     verbose=True)
    return state_dict


def create_vit_qimia(variant: str, pretrained: bool, model_args: Dict[str, Any], **kwargs) -> VisionTransformerQimia:
    """``variant`` built from ``model_args`` and a user's ``kwargs``, with its pretrained weights."""
    return build_vit(VisionTransformerQimia, variant, pretrained, checkpoint_filter_fn, **dict(model_args, **kwargs))


def _cfg(**kwargs) -> Dict[str, Any]:
    return vit_cfg(**{'paper_name': 'Query Integrated Memory Interfacing Attention (SURF Final Report, 2023)',
                      **kwargs})


# The first tag of a model is its default; .untrained tags are architectures without weights.
default_cfgs = generate_default_cfgs({
    'vit_qimia_tiny.cifar10_30ep': _cfg(cifar10=True, **cifar10_weights('vit_qimia_tiny.cifar10_30ep')),
    'vit_qimia_tiny.untrained': _cfg(cifar10=True),
    'vit_qimia_small.untrained': _cfg(cifar10=True),
    'vit_qimia_base.untrained': _cfg(cifar10=True),
    'vit_qimia_surf23_patch8_32.untrained': _cfg(cifar10=True),
    'vit_qimia_tiny_patch16_224.untrained': _cfg(),
    'vit_qimia_small_patch16_224.untrained': _cfg(),
    'vit_qimia_base_patch16_224.untrained': _cfg(),
})

# ViT-Ti/S/B widths; keys a third of the width (the default), depth heads of 8 key channels
_TINY = dict(embed_dim=192, depth=12, num_heads=3)
_SMALL = dict(embed_dim=384, depth=12, num_heads=6)
_BASE = dict(embed_dim=768, depth=12, num_heads=12)


@register_model
def vit_qimia_tiny(pretrained: bool = False, **kwargs) -> VisionTransformerQimia:
    """QIMIA ViT-Ti (192 wide, 12 layers, 3 heads, keys 64 wide in 8 depth heads), patch 4 at 32 x 32."""
    return create_vit_qimia('vit_qimia_tiny', pretrained, dict(patch_size=4, **_TINY), **kwargs)


@register_model
def vit_qimia_small(pretrained: bool = False, **kwargs) -> VisionTransformerQimia:
    """QIMIA ViT-S (384 wide, 12 layers, 6 heads, keys 128 wide in 16 depth heads), patch 4 at 32 x 32."""
    return create_vit_qimia('vit_qimia_small', pretrained, dict(patch_size=4, **_SMALL), **kwargs)


@register_model
def vit_qimia_base(pretrained: bool = False, **kwargs) -> VisionTransformerQimia:
    """QIMIA ViT-B (768 wide, 12 layers, 12 heads, keys 256 wide in 32 depth heads), patch 4 at 32 x 32."""
    return create_vit_qimia('vit_qimia_base', pretrained, dict(patch_size=4, **_BASE), **kwargs)


@register_model
def vit_qimia_surf23_patch8_32(pretrained: bool = False, **kwargs) -> VisionTransformerQimia:
    """The SURF report's CIFAR configuration (appendix): 256 wide, depth 10, patch 8, feed-forward 1024, keys 256
    wide in 32 depth heads, 8 token-attention heads (the authors' code), at 32 x 32."""
    model_args = dict(patch_size=8, embed_dim=256, depth=10, num_heads=8, mlp_ratio=4., key_dim=256)
    return create_vit_qimia('vit_qimia_surf23_patch8_32', pretrained, model_args, **kwargs)


@register_model
def vit_qimia_tiny_patch16_224(pretrained: bool = False, **kwargs) -> VisionTransformerQimia:
    """QIMIA ViT-Ti/16 at 224 x 224."""
    return create_vit_qimia('vit_qimia_tiny_patch16_224', pretrained, dict(patch_size=16, **_TINY), **kwargs)


@register_model
def vit_qimia_small_patch16_224(pretrained: bool = False, **kwargs) -> VisionTransformerQimia:
    """QIMIA ViT-S/16 at 224 x 224."""
    return create_vit_qimia('vit_qimia_small_patch16_224', pretrained, dict(patch_size=16, **_SMALL), **kwargs)


@register_model
def vit_qimia_base_patch16_224(pretrained: bool = False, **kwargs) -> VisionTransformerQimia:
    """QIMIA ViT-B/16 at 224 x 224."""
    return create_vit_qimia('vit_qimia_base_patch16_224', pretrained, dict(patch_size=16, **_BASE), **kwargs)
