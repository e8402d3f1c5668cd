"""benchmarks/throughput.py: every candidate against timm's ViT (and MLP-Mixer) of the same size, in one run."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import timm
import torch

ROOT = Path(__file__).resolve().parents[2]


def load_throughput():
    spec = importlib.util.spec_from_file_location('throughput', ROOT / 'benchmarks' / 'throughput.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize('name', ['vit_hyperbf_tiny', 'vit_qimia_tiny', 'vit_hyperbf_tiny_patch16_224'])
def test_baselines_have_the_candidates_size(name):
    bench = load_throughput()
    candidate = timm.create_model(name, device='meta')
    dims = bench.dimensions(candidate)
    vit = timm.create_model(**bench.vit_args(dims), device='meta')
    mixer = bench.build(bench.mixer_args(dims), 'cpu')
    for baseline, patch_embed in ((vit, vit.patch_embed), (mixer, mixer.stem)):
        assert baseline.embed_dim == candidate.embed_dim
        assert len(baseline.blocks) == len(candidate.blocks)
        assert patch_embed.patch_size == candidate.patch_embed.patch_size
        assert patch_embed.img_size == candidate.patch_embed.img_size
        assert baseline.num_classes == candidate.num_classes
    assert vit.blocks[0].attn.num_heads == dims['num_heads']
    assert vit.blocks[0].mlp.fc1.out_features == dims['hidden']
    assert mixer.blocks[0].mlp_channels.fc1.out_features == dims['hidden']


def test_variants_are_valid_models():
    for name, variants in load_throughput().VARIANTS.items():
        for kwargs in variants.values():
            timm.create_model(name, device='meta', **kwargs)


def test_a_run_writes_every_model_with_ratios_to_the_vit_and_a_plot(tmp_path, monkeypatch):
    out = tmp_path / 'bench.json'
    monkeypatch.setattr(sys, 'argv', [
        'throughput.py', '--models', 'vit_hyperbf_tiny', '--batch-size', '2', '--warmup', '1', '--steps', '1',
        '--rounds', '2', '--mixer', '--json', str(out)])
    bench = load_throughput()
    monkeypatch.setattr(bench, 'VARIANTS', {'vit_hyperbf_tiny': {'vit_hyperbf_tiny, depth=2': dict(depth=2)}})
    threads = torch.get_num_threads()
    try:
        bench.main()
    finally:
        torch.set_num_threads(threads)
    record = json.loads(out.read_text())
    assert [r['mode'] for r in record['results']] == ['infer', 'train']
    for row in record['results']:
        assert list(row['models']) == ['vit_hyperbf_tiny', 'vit_hyperbf_tiny, depth=2', 'timm ViT', 'timm MLP-Mixer']
        assert row['models']['vit_hyperbf_tiny, depth=2']['spec'] == dict(model_name='vit_hyperbf_tiny', depth=2)
        assert row['models']['timm ViT']['throughput_ratio'] == 1.
        assert row['models']['timm ViT']['throughput_ratio_range'] == [1., 1.]
        assert row['models']['timm ViT']['memory_ratio'] == 1.
        for entry in row['models'].values():
            assert len(entry['rounds']) == 2 and entry['images_per_s'] > 0 and entry['peak_mib'] > 0
    assert record['environment']['command'].endswith('--mixer --json ' + str(out))
    assert (tmp_path / 'bench.png').stat().st_size > 0


def test_throughput_ratios_pair_each_round_with_the_same_round_of_the_vit():
    paired_ratio = load_throughput().paired_ratio
    # 0.9x the ViT in every round, while the machine's load changes from round to round
    ratio = paired_ratio([90., 45., 99.], [100., 50., 110.])
    assert ratio['median'] == pytest.approx(0.9) and ratio['range'] == pytest.approx([0.9, 0.9])
    # round ratios 0.8, 1.11 and 0.75: median 0.8, where the ratio of the medians (80 / 90) would say 0.89
    ratio = paired_ratio([80., 100., 60.], [100., 90., 80.])
    assert ratio['median'] == pytest.approx(0.8) and ratio['range'] == pytest.approx([0.75, 100. / 90.])


def test_memory_is_measured_with_the_mmap_threshold_pinned(monkeypatch):
    """Peak RSS counts live tensors only if freed large blocks go back to the system at once."""
    throughput = load_throughput()
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(kwargs['env'])
        return type('Done', (), {'stdout': 'building\n123.5\n'})()

    monkeypatch.setattr(throughput.subprocess, 'run', fake_run)
    args = type('Args', (), dict(device='cpu', amp=False, compile=False))()
    assert throughput.peak_memory({'model_name': 'vit_hyperbf_tiny'}, (3, 32, 32), 2, True, args) == 123.5
    assert calls[0]['MALLOC_MMAP_THRESHOLD_'] == str(128 * 1024)
