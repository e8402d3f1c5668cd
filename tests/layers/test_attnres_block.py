"""AttnResBlock: timm's ViT block, by its module names, with depth reads and writes in place of its residual adds."""
import torch
import torch.nn.functional as F
from timm.models.vision_transformer import Block

from timm_hbf.layers import AttnResBlock, DepthAttention


def test_with_zero_queries_it_computes_timm_s_block_up_to_the_scale_layernorm_removes():
    """A block over the embedding alone: the first sublayer takes it as it is, the second reads the average of it and
    the first's output, ``x1 / 2``, which its LayerNorm takes as ``x1``; the average of all three entries is timm's
    block output over 3, the same after a LayerNorm."""
    torch.manual_seed(0)
    block = Block(48, 3, qkv_bias=True, init_values=.5)
    read1, read2, read_out = (DepthAttention(48, 1, key_norm='rms', query=q) for q in (False, True, True))
    ours = AttnResBlock(48, 3, read1, read2, init_values=.5)
    assert ours.load_state_dict(block.state_dict(), strict=False) == (['read2.query'], [])
    x = torch.randn(2, 5, 48) * 3
    memory = read_out.start([read2.memory_query(), read_out.memory_query()])
    memory = read_out.store(memory, read_out.key(x), x)
    out, _ = read_out(ours(memory))
    torch.testing.assert_close(F.layer_norm(out, [48]), F.layer_norm(block(x), [48]), rtol=0, atol=1e-4)
