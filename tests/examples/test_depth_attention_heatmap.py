"""examples/depth_attention_heatmap.py: the depth-attention matrix of a QIMIA model, drawn from real test images."""
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import load_module

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / 'examples'
MINI = ROOT / 'data' / 'cifar10-mini-jpeg.tar.gz'  # the repository's CIFAR-10 sample


@pytest.fixture
def heatmap_script(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))  # the script imports its neighbour train_cifar10
    yield load_module(EXAMPLES / 'depth_attention_heatmap.py')
    sys.modules.pop('train_cifar10', None)


def test_untrained_model_reads_uniformly_and_the_heatmap_is_drawn(heatmap_script, tmp_path, capsys):
    import matplotlib.image

    out = tmp_path / 'heatmap.png'
    stats = heatmap_script.main([
        '--model', 'vit_qimia_tiny', '--model-kwargs', 'depth=2', '--data', str(MINI), '--images', '16',
        '--cache-dir', str(tmp_path / 'cache'), '--out', str(out),
    ])
    torch.testing.assert_close(stats['entropy'], torch.ones(5))
    assert 'mean entropy 1.000 over 5 reads' in capsys.readouterr().out
    image = matplotlib.image.imread(out)
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 300
    assert image[..., :3].std() > .05  # not a blank canvas


def test_models_without_depth_attention_are_refused(heatmap_script, tmp_path):
    with pytest.raises(SystemExit, match='no depth attention'):
        heatmap_script.main(['--model', 'vit_hyperbf_tiny', '--model-kwargs', 'depth=1', '--data', str(MINI),
                             '--out', str(tmp_path / 'x.png')])
