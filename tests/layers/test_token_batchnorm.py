"""BatchNorm over the channel (last) dim of token tensors: statistics over every token of the batch."""
import copy

import torch
from timm.layers import convert_sync_batchnorm

from timm_hbf.layers import TokenBatchNorm


def test_normalizes_each_channel_over_every_token_of_the_batch():
    norm = TokenBatchNorm(4)
    x = torch.randn(3, 5, 4) * torch.tensor([1., 2., 3., 4.]) + torch.tensor([0., 1., -2., 5.])
    y = norm(x)
    assert y.shape == x.shape
    torch.testing.assert_close(y.mean((0, 1)), torch.zeros(4), rtol=0, atol=1e-5)
    torch.testing.assert_close(y.var((0, 1), unbiased=False), torch.ones(4), rtol=0, atol=1e-3)
    torch.testing.assert_close(norm.norm.running_mean, .1 * x.mean((0, 1)))


def test_eval_uses_the_running_statistics():
    norm = TokenBatchNorm(4)
    norm(torch.randn(2, 6, 4) * 3 + 1)
    norm.eval()
    x = torch.randn(1, 6, 4)
    expected = (x - norm.norm.running_mean) / (norm.norm.running_var + norm.norm.eps).sqrt()
    torch.testing.assert_close(norm(x), expected)


def test_train_py_s_sync_batchnorm_conversion_keeps_the_token_layout():
    """``train.py --sync-bn`` swaps the inner ``BatchNorm1d`` for ``SyncBatchNorm``, which takes the same ``(tokens,
    channels)`` input; outside a process group it computes what the BatchNorm did."""
    norm = TokenBatchNorm(4)
    synced = convert_sync_batchnorm(copy.deepcopy(norm))
    assert isinstance(synced.norm, torch.nn.SyncBatchNorm)
    x = torch.randn(3, 5, 4) * 2 + 1
    torch.testing.assert_close(synced(x), norm(x))
    torch.testing.assert_close(synced.norm.running_var, norm.norm.running_var)
    synced.eval(), norm.eval()
    torch.testing.assert_close(synced(x[:1]), norm(x[:1]))
