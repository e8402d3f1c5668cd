"""benchmarks/block_memory.py: QIMIA's block memory against depth, beside timm's ViT, in fresh processes."""
import json
import sys
from pathlib import Path

from tests.helpers import load_module

ROOT = Path(__file__).resolve().parents[2]


def load_block_memory():
    return load_module(ROOT / 'benchmarks' / 'block_memory.py')


def test_a_run_measures_every_block_size_and_depth_beside_the_vit(tmp_path, monkeypatch):
    out = tmp_path / 'memory.json'
    monkeypatch.setattr(sys, 'argv', ['block_memory.py', '--depths', '2', '4', '--block-sizes', '1', '4',
                                      '--batch-size', '64', '--json', str(out)])
    bench = load_block_memory()
    measure = bench.throughput.peak_memory

    def peak_memory(spec, *args):  # QIMIA in fresh processes; the ViT is a fixed figure, to save their start-up
        return 40. + spec['depth'] if spec['model_name'] == 'vit_base_patch16_224' else measure(spec, *args)

    monkeypatch.setattr(bench.throughput, 'peak_memory', peak_memory)
    bench.main()
    record = json.loads(out.read_text())
    assert record['environment']['mode'] == 'infer' and record['environment']['batch_size'] == 64
    rows = {(r['depth'], r['model']): r for r in record['results']}
    labels = ['vit_qimia_tiny, memory_block_size=1', 'vit_qimia_tiny, memory_block_size=4', 'timm ViT']
    assert list(rows) == [(depth, label) for depth in (2, 4) for label in labels]
    for (depth, label), row in rows.items():
        assert set(row['peak_mib']) == {'eager'}
        assert row['memory_ratio']['eager'] == row['peak_mib']['eager'] / rows[depth, 'timm ViT']['peak_mib']['eager']
    # From depth 2 to 4 the full memory gains four entries and block memory one summary, besides the same two layers'
    # parameters: at batch 64 an entry (65 tokens, 64 key and 192 value channels, float32) is 4 MiB
    growth = [rows[4, label]['peak_mib']['eager'] - rows[2, label]['peak_mib']['eager'] for label in labels[:2]]
    assert growth[0] - growth[1] > 0.8 * 3 * 64 * 65 * 256 * 4 / 2 ** 20
    assert '| 4 | `vit_qimia_tiny, memory_block_size=4` |' in (tmp_path / 'memory.md').read_text()
