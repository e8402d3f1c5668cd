"""The HyperBF layer that replaces the Transformer MLP (CBMM Memo 143, Sec. 2.2.2, Eq. 4 and 7).

    phi(x) = sum_i c_i K(x, t_i) + b,       K(x, t_i) = exp(-gamma_i ||W (x - t_i)||^2)

with learned centres ``t_i``, one width ``gamma_i`` per centre and coefficients ``c_i``. Normalised, the weights
become ``softmax_i(log K(x, t_i))``: attention of each token over a learned memory (memo Eq. 2).
"""
import math
from typing import Optional, Type

import torch
from torch import nn
from torch.jit import Final

from .._checks import check_count
from .hyperbf_kernel import HyperBFKernel

__all__ = ['HyperBFMlp', 'init_gamma']


def init_gamma(dim: int, kernel: str, normalized: bool) -> float:
    """Initial width for centres ``N(0, I)`` and LayerNorm'd inputs, where ``||x - t||^2`` is about ``2 dim``.

    Unnormalised units start with ``gamma * distance`` about 1 (``K`` about ``exp(-1)``); normalised units start with
    logits that vary across centres by about 1, as in scaled dot-product attention.
    """
    if kernel == 'gaussian':
        return 1. / (2. * math.sqrt(dim)) if normalized else 1. / (2. * dim)
    return 1. if normalized else 1. / math.sqrt(2. * dim)


class HyperBFMlp(nn.Module):
    """A layer of HyperBF units with a linear readout, in the place of timm's ``Mlp``.

    Takes the arguments timm's ViT ``Block`` passes to its MLP: ``act_layer`` is accepted and unused (the kernel is
    the units' nonlinearity), ``norm_layer`` normalises the unit activations before the readout (``scale_mlp_norm``),
    ``bias`` is the readout's.

    Every unit is alive at init: on LayerNorm'd inputs and ``N(0, I)`` centres ``||x - t||^2`` is about ``2 D``, so
    independent Gaussian units start at ``gamma = 1 / (2 D)``, where ``K`` is about ``exp(-1)`` (the other kernels
    and normalised units: :func:`init_gamma`); the authors' ``gamma = 0.1`` gives ``exp(-154)`` at ``D = 768``,
    zero in fp32, and no gradient (docs/hyperbf.md). The layer costs one matrix product of width ``num_centers``
    plus the readout, as an MLP of the same hidden width does.

    Args:
        in_features: Input dimension ``D``.
        hidden_features: Number of centres, at least 1 (``None``: ``in_features``).
        out_features: Output dimension (``None``: ``in_features``).
        act_layer: Unused; accepted as timm's ``Block`` passes it.
        norm_layer: Norm over the unit activations before the readout (none by default).
        bias: Bias ``b`` of the readout.
        drop: Dropout on the unit activations and on the output.
        kernel: ``'gaussian'`` or ``'laplacian'``.
        mahalanobis: Learn a metric ``W^T W`` shared by the centres.
        normalized: Softmax over the centres instead of independent Gaussian units.
    """
    normalized: Final[bool]
    __jit_unused_properties__ = ['fc2']  # Python-side alias, not part of the scripted model

    def __init__(
            self,
            in_features: int,
            hidden_features: Optional[int] = None,
            out_features: Optional[int] = None,
            act_layer: Optional[Type[nn.Module]] = None,
            norm_layer: Optional[Type[nn.Module]] = None,
            bias: bool = True,
            drop: float = 0.,
            kernel: str = 'gaussian',
            mahalanobis: bool = False,
            normalized: bool = False,
            device: torch.types.Device = None,
            dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        hidden_features = in_features if hidden_features is None else hidden_features
        out_features = in_features if out_features is None else out_features
        check_count('in_features', in_features)
        check_count('hidden_features (the number of centres; mlp_ratio * embed_dim in a ViT)', hidden_features)
        self.normalized = normalized
        self.centers = nn.Parameter(torch.empty(hidden_features, in_features, **dd))
        self.kernel = HyperBFKernel(
            in_features,
            num_widths=hidden_features,
            gamma_init=init_gamma(in_features, kernel, normalized),
            kernel=kernel,
            mahalanobis=mahalanobis,
            **dd,
        )
        self.drop1 = nn.Dropout(drop)
        self.norm = norm_layer(hidden_features, **dd) if norm_layer is not None else nn.Identity()
        self.readout = nn.Linear(hidden_features, out_features, bias=bias, **dd)
        self.drop2 = nn.Dropout(drop)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.centers)

    def init_weights(self) -> None:
        """Called by the ViT weight init: centres keep their N(0, 1) init, unlike Linears."""
        self.reset_parameters()

    @property
    def fc2(self) -> nn.Linear:
        """The readout, by the name timm's ViT gives the last layer of an MLP (``fix_init`` rescales it)."""
        return self.readout

    def log_units(self, x: torch.Tensor) -> torch.Tensor:
        """The unit exponents ``log K(x, t_i)``: ``(..., D) -> (..., num_centers)``, in float32 (or wider)."""
        return self.kernel.log_kernel(
            self.kernel.project(x), self.kernel.project(self.centers), self.kernel.gamma().unsqueeze(0))

    def activations(self, x: torch.Tensor) -> torch.Tensor:
        """The unit activations ``K(x, t_i)`` (or their softmax when normalised): ``(..., D) -> (..., num_centers)``,
        computed in float32 (or wider) and returned in the dtype of ``x``."""
        log_k = self.log_units(x)
        return (log_k.softmax(dim=-1) if self.normalized else log_k.exp_()).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.activations(x)
        x = self.drop1(x)
        x = self.norm(x)
        x = self.readout(x)
        x = self.drop2(x)
        return x
