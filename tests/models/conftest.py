"""What the model tests share: both kinds of timm's gradient checkpointing."""
import pytest
from timm.layers import set_reentrant_ckpt, use_reentrant_ckpt


@pytest.fixture(params=[False, True], ids=['non_reentrant', 'reentrant'])
def checkpointing_reentrant(request) -> bool:
    """timm's gradient checkpointing non-reentrant (its default) or reentrant (``timm.layers.set_reentrant_ckpt``,
    which tracks only tensors passed as arguments), for the test; restored after it."""
    before = use_reentrant_ckpt()
    set_reentrant_ckpt(request.param)
    yield request.param
    set_reentrant_ckpt(before)
