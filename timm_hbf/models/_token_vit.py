"""The ViT skeleton shared by the model families: patch embedding, class token, learned position embedding, a stack
of blocks, final norm and classifier head, with the model API that timm's factory, features, optimizers and
train.py rely on.

A family subclasses :class:`TokenViT`, calls :meth:`TokenViT._init_stem`, builds ``self.blocks`` (an
``nn.Sequential`` or ``nn.ModuleList``) and calls :meth:`TokenViT._init_head`, in that order, so that parameters
are registered stem, blocks, head (train.py's adaptive gradient clipping leaves out the last two parameters: the
head's).
"""
from typing import Dict, List, Optional, Set, Tuple, Union

import torch
from timm.layers import PatchEmbed, resample_abs_pos_embed, resample_patch_embed, trunc_normal_
from timm.models import checkpoint, checkpoint_seq, named_apply
from torch import nn
from torch.jit import Final

__all__ = ['CIFAR10_MEAN', 'CIFAR10_STD', 'TokenViT', 'checkpoint_filter_fn', 'take_indices']

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)

GLOBAL_POOLS = ('', 'token', 'avg')
# HyperBF widths, centres and metrics; depth-attention queries (decay would pull them back to uniform reads)
NO_DECAY_PARAM_NAMES = ('log_gamma', 'centers', 'metric', 'query')


def take_indices(
        num_blocks: int,
        indices: Optional[Union[int, List[int], Tuple[int, ...]]] = None,
) -> Tuple[List[int], int]:
    """Absolute block indices to return, and the largest: all (None), the last ``n`` (int) or the listed ones
    (negative indices count from the end)."""
    if indices is None:
        indices = num_blocks
    if isinstance(indices, int):
        if not 0 < indices <= num_blocks:
            raise ValueError(f'Cannot take the last {indices} of {num_blocks} blocks.')
        taken = list(range(num_blocks - indices, num_blocks))
    else:
        taken = [num_blocks + i if i < 0 else i for i in indices]
        bad = [i for i, t in zip(indices, taken) if not 0 <= t < num_blocks]
        if bad:
            raise ValueError(f'Block indices {bad} are out of range for {num_blocks} blocks.')
    return taken, max(taken)


def _init_weights(module: nn.Module, name: str = '') -> None:
    """ViT init: trunc-normal(0.02) Linears with zero bias; modules with their own ``init_weights`` use it."""
    if isinstance(module, nn.Linear):
        trunc_normal_(module.weight, std=.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif hasattr(module, 'init_weights'):
        module.init_weights()


class TokenViT(nn.Module):
    """Base class of the token-sequence vision transformers in this package (see the module docstring)."""
    dynamic_img_size: Final[bool]

    def _init_stem(
            self,
            img_size: Union[int, Tuple[int, int]],
            patch_size: Union[int, Tuple[int, int]],
            in_chans: int,
            embed_dim: int,
            class_token: bool,
            pos_drop_rate: float,
            dynamic_img_size: bool,
            dynamic_img_pad: bool,
            device=None,
            dtype=None,
    ) -> None:
        dd = {'device': device, 'dtype': dtype}
        self.in_chans = in_chans
        self.embed_dim = self.num_features = self.head_hidden_size = embed_dim
        self.num_prefix_tokens = 1 if class_token else 0
        self.has_class_token = class_token
        self.dynamic_img_size = dynamic_img_size
        self.grad_checkpointing = False
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

    def _init_head(
            self,
            num_classes: int,
            global_pool: str,
            drop_rate: float,
            depth: int,
            device=None,
            dtype=None,
    ) -> None:
        dd = {'device': device, 'dtype': dtype}
        if global_pool not in GLOBAL_POOLS:
            raise ValueError(f"Unknown global_pool '{global_pool}': use one of {GLOBAL_POOLS}.")
        if global_pool == 'token' and not self.has_class_token:
            raise ValueError("global_pool='token' needs class_token=True; use global_pool='avg' without a class token.")
        self.num_classes = num_classes
        self.global_pool = global_pool
        patch = self.patch_embed.patch_size
        self.feature_info = [
            dict(module=f'blocks.{i}', num_chs=self.embed_dim, reduction=patch[0]) for i in range(depth)
        ]
        self.norm = nn.LayerNorm(self.embed_dim, eps=1e-6, **dd)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(self.embed_dim, num_classes, **dd) if num_classes > 0 else nn.Identity()

    def init_weights(self, mode: str = '') -> None:
        if mode not in ('', 'skip'):
            raise ValueError(f"Unknown weight_init '{mode}': use '' (ViT init) or 'skip'.")
        if mode == 'skip':
            return
        trunc_normal_(self.pos_embed, std=.02)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)
        named_apply(_init_weights, self, include_root=False)

    # --- parameter groups -------------------------------------------------------------------------------------------

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        """Position embedding, class token, every HyperBF width, centre and metric and every depth-attention query:
        decaying them to zero would collapse kernels and attention rather than regularise them."""
        kernel_params = {n for n, _ in self.named_parameters() if n.rsplit('.', 1)[-1] in NO_DECAY_PARAM_NAMES}
        return {'pos_embed', 'cls_token'} | kernel_params

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict:
        return dict(
            stem=r'^cls_token|pos_embed|patch_embed',
            blocks=[(r'^blocks\.(\d+)', None), (r'^norm', (99999,))],
        )

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    # --- classifier -------------------------------------------------------------------------------------------------

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

    # --- input size -------------------------------------------------------------------------------------------------

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
        patch = self.patch_embed.patch_size
        for info in self.feature_info:
            info['reduction'] = patch[0]

    # --- forward ----------------------------------------------------------------------------------------------------

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        pos_embed = self.pos_embed
        if self.dynamic_img_size:
            B, H, W, C = x.shape
            pos_embed = resample_abs_pos_embed(pos_embed, new_size=[H, W], num_prefix_tokens=self.num_prefix_tokens)
            x = x.view(B, -1, C)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.pos_drop(x + pos_embed)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Images ``(B, C, H, W)`` to position-embedded tokens ``(B, prefix + patches, D)``."""
        return self._pos_embed(self.patch_embed(x))

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        if self.grad_checkpointing and not torch.jit.is_scripting():
            x = checkpoint_seq(self.blocks, x)
        else:
            x = self.blocks(x)
        return self.norm(x)

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        if self.global_pool == 'token':
            return x[:, 0]
        if self.global_pool == 'avg':
            return x[:, self.num_prefix_tokens:].mean(dim=1)
        return x

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.pool(x)
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    # --- intermediates and features ---------------------------------------------------------------------------------

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
        """Block outputs along with (or instead of) the final features.

        Args:
            x: Images ``(B, C, H, W)``.
            indices: Last ``n`` blocks if int, all if None, else the listed block indices.
            return_prefix_tokens: Return ``(spatial, prefix)`` pairs instead of spatial tokens alone.
            norm: Apply the final norm to each intermediate.
            stop_early: Stop after the last block that is asked for.
            output_fmt: ``'NCHW'`` feature maps or ``'NLC'`` token sequences.
            intermediates_only: Return only the intermediates.
        """
        if output_fmt not in ('NCHW', 'NLC'):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got '{output_fmt}'.")
        taken, max_index = take_indices(len(self.blocks), indices)
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

    def _forward_taken(self, x: torch.Tensor, taken: List[int], last: int) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """Run blocks ``0..last``: the features before the final norm, and the outputs of the ``taken`` blocks."""
        x = self.embed(x)
        intermediates = []
        for i, block in enumerate(self.blocks[:last + 1]):
            x = checkpoint(block, x) if self.grad_checkpointing else block(x)
            if i in taken:
                intermediates.append(x)
        return x, intermediates

    @torch.jit.ignore
    def prune_intermediate_layers(
            self,
            indices: Union[int, List[int]] = 1,
            prune_norm: bool = False,
            prune_head: bool = True,
    ) -> List[int]:
        """Drop the blocks after the last index asked for (and the norm, the head); returns the kept indices."""
        taken, max_index = take_indices(len(self.blocks), indices)
        self.blocks = self.blocks[:max_index + 1]
        self.feature_info = self.feature_info[:max_index + 1]
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.reset_classifier(0, '')
        return taken


def checkpoint_filter_fn(state_dict: Dict[str, torch.Tensor], model: TokenViT) -> Dict[str, torch.Tensor]:
    """Adapt a checkpoint to ``model``: unwrap train.py's ``state_dict``, resample the position embedding to the
    model's grid and the patch embedding to its patch size."""
    state_dict = state_dict.get('state_dict', state_dict.get('model', state_dict))
    out = {}
    for k, v in state_dict.items():
        if k == 'pos_embed' and v.shape != model.pos_embed.shape:
            v = resample_abs_pos_embed(
                v,
                new_size=list(model.patch_embed.grid_size),
                num_prefix_tokens=model.num_prefix_tokens,
                verbose=True,
            )
        elif k == 'patch_embed.proj.weight' and v.shape[-2:] != model.patch_embed.proj.weight.shape[-2:]:
            v = resample_patch_embed(v, list(model.patch_embed.patch_size), verbose=True)
        out[k] = v
    return out
