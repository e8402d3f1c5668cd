"""benchmarks/attention.py: HyperBF's attention layer and core against timm's Attention and SDPA, in paired rounds,
with each HyperBF contender checked against the formula; rehearsed on the CPU at tiny sizes (``--quick``)."""
import json
from pathlib import Path

import pytest
import torch

from tests.helpers import load_module

ROOT = Path(__file__).resolve().parents[2]


def load_attention():
    return load_module(ROOT / 'benchmarks' / 'attention.py')


@pytest.fixture
def bench():
    threads = torch.get_num_threads()
    yield load_attention()
    torch.set_num_threads(threads)


def test_a_quick_run_times_every_contender_against_its_reference(bench, tmp_path):
    out = tmp_path / 'attention.json'
    bench.main(['--quick', '--backends', 'math', 'efficient', '--json', str(out)])
    record = json.loads(out.read_text())
    env = record['environment']
    assert env['device'].startswith('CPU') and env['torch'] == torch.__version__ and 'cuda' in env
    assert env['date'] and env['command'].endswith(f'--json {out}') and env['head_dim'] == 64
    assert [(r['tokens'], r['mode']) for r in record['results']] == [
        (16, 'infer'), (16, 'train'), (32, 'infer'), (32, 'train')]
    for row in record['results']:
        contenders = row['contenders']
        assert list(contenders) == ['timm Attention', 'HyperBFAttention', 'SDPA', 'gaussian_sdpa', 'SDPA [math]',
                                    'gaussian_sdpa [math]', 'SDPA [efficient]', 'gaussian_sdpa [efficient]']
        assert contenders['HyperBFAttention']['reference'] == 'timm Attention'
        assert contenders['gaussian_sdpa [math]']['reference'] == 'SDPA [math]'
        for label in ('timm Attention', 'HyperBFAttention', 'SDPA', 'gaussian_sdpa', 'gaussian_sdpa [math]'):
            r = contenders[label]
            assert len(r['rounds']) == 2 and all(speed > 0 for speed in r['rounds'])
            assert r['ratio_range'][0] <= r['ratio'] <= r['ratio_range'][1]
        assert contenders['timm Attention']['ratio'] == 1.
        # the CPU has no memory-efficient kernel: recorded, and the others go on
        assert contenders['SDPA [efficient]']['unsupported'].startswith('RuntimeError')
        for label in ('HyperBFAttention', 'gaussian_sdpa', 'gaussian_sdpa [math]'):  # checked in inference, float32
            error = contenders[label]['error']
            assert (error < 1e-5) if row['mode'] == 'infer' else error is None
    table = (tmp_path / 'attention.md').read_text()
    assert table.startswith('| tokens | batch | mode | contender | ms/step |')
    assert '| 32 | 2 | train | gaussian_sdpa [math] |' in table
    assert '| SDPA [efficient] | unsupported: RuntimeError' in table
    assert (tmp_path / 'attention.png').read_bytes()[:4] == b'\x89PNG'


@pytest.mark.filterwarnings('ignore:flex_attention called without torch.compile')
def test_flex_attention_with_a_key_bias_computes_the_formula(bench, monkeypatch):
    """FlexAttention's eager reference (no compiling here): queries scaled by 2 gamma, -gamma ||k||^2 per key."""
    monkeypatch.setattr(torch, 'compile', lambda fn, **kwargs: fn)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, 16, 64, generator=g) for _ in range(3))
    gamma = torch.tensor([0.05, 0.1]).view(-1, 1, 1)  # one width per head
    torch.testing.assert_close(bench.flex_gaussian()(q, k, v, gamma), bench.formula(q, k, v, gamma), atol=1e-5,
                               rtol=1e-5)
