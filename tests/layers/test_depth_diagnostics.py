"""Diagnostics of attention over depth: Eq. 1's weights from stored keys, and the report's entropy metric."""
import pytest
import torch

from tests.layers.test_depth_attention import memory, read_with_query
from timm_hbf.layers import depth_weights, normalized_entropy


def test_weights_are_the_softmax_over_entries_in_float32_entries_last():
    keys, _ = memory(dtype=torch.bfloat16, shared=True)
    weights = depth_weights(read_with_query(dtype=torch.float32).memory_query(), keys)
    assert weights.shape == (2, 3, 2, 1, 5) and weights.dtype == torch.float32
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 3, 2, 1))


def test_normalized_entropy_is_one_for_uniform_and_zero_for_one_hot():
    assert normalized_entropy(torch.full((2, 3, 4), .25)).item() == pytest.approx(1.)
    one_hot = torch.zeros(2, 3, 4)
    one_hot[..., 1] = 1.
    assert normalized_entropy(one_hot).item() == pytest.approx(0., abs=1e-6)
