"""benchmarks/throughput.py: every candidate against timm's ViT (and MLP-Mixer) of the same size, in one run."""
import json
import statistics
import sys
from pathlib import Path

import pytest
import timm
import torch

from tests.helpers import load_module

ROOT = Path(__file__).resolve().parents[2]


def load_throughput():
    return load_module(ROOT / 'benchmarks' / 'throughput.py')


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


def run(monkeypatch, *argv, variants=None):
    """benchmarks/throughput.py's main() on ``argv``; returns the module."""
    monkeypatch.setattr(sys, 'argv', ['throughput.py', *argv])
    bench = load_throughput()
    if variants is not None:
        monkeypatch.setattr(bench, 'VARIANTS', variants)
    threads = torch.get_num_threads()
    try:
        bench.main()
    finally:
        torch.set_num_threads(threads)
    return bench


TINY_RUN = ('--models', 'vit_hyperbf_tiny', '--model-kwargs', 'depth=2', '--batch-size', '2', '--warmup', '1',
            '--steps', '1', '--rounds', '2')


def test_a_run_writes_every_model_with_its_macs_ratios_table_and_plot(tmp_path, monkeypatch):
    out = tmp_path / 'bench.json'
    run(monkeypatch, *TINY_RUN, '--mixer', '--json', str(out),
        variants={'vit_hyperbf_tiny': {'vit_hyperbf_tiny, depth=1': dict(depth=1)}})
    record = json.loads(out.read_text())
    assert [r['mode'] for r in record['results']] == ['infer', 'train']
    for row in record['results']:
        models = row['models']
        assert list(models) == ['vit_hyperbf_tiny', 'vit_hyperbf_tiny, depth=1', 'timm ViT', 'timm MLP-Mixer']
        assert models['vit_hyperbf_tiny']['spec'] == dict(model_name='vit_hyperbf_tiny', depth=2)
        assert models['vit_hyperbf_tiny, depth=1']['spec'] == dict(model_name='vit_hyperbf_tiny', depth=1)
        assert models['timm ViT']['spec']['depth'] == models['timm MLP-Mixer']['spec']['num_blocks'] == 2
        for entry in models.values():
            assert set(entry) == {'spec', 'macs', 'ceiling', 'read_bytes', 'eager'}
            assert len(entry['eager']['rounds']) == 2 and entry['eager']['peak_mib'] > 0
            # no reads over depth: the roofline is the arithmetic ceiling
            assert entry['read_bytes'] == 0 and entry['eager']['roofline'] == pytest.approx(entry['ceiling'])
        # the baselines have the candidate's 2 blocks: half the arithmetic in one block, a ceiling about twice as high
        full, shallow = models['vit_hyperbf_tiny'], models['vit_hyperbf_tiny, depth=1']
        assert 1.7 < full['macs'] / shallow['macs'] < 2.1 and shallow['ceiling'] / full['ceiling'] > 1.7
        assert 0.9 < full['ceiling'] < 1.1  # HyperBF units cost what the ViT's do
    assert record['environment']['command'].endswith('--mixer --json ' + str(out))
    assert record['environment']['copy_bandwidth_gbs'] > 0
    table = (tmp_path / 'bench.md').read_text()
    assert '| `vit_hyperbf_tiny` | 32/4 | train | 2 |' in table and table.count('\n| timm ViT |') == 2
    assert (tmp_path / 'bench.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def test_compiled_models_are_timed_beside_eager_against_the_compiled_vit(tmp_path, monkeypatch):
    """With --compiled every model also runs under torch.compile (here its aot_eager backend, which compiles without
    a C++ toolchain), and its ratios pair each round with the compiled ViT's."""
    compiled, compile_with = [], torch.compile

    def compile_(model):
        compiled.append(type(model).__name__)
        return compile_with(model, backend='aot_eager')

    monkeypatch.setattr(torch, 'compile', compile_)
    out = tmp_path / 'bench.json'
    bench = load_throughput()
    monkeypatch.setattr(bench, 'peak_memory', lambda *args: 1.)  # measured in fresh processes: see the eager test
    monkeypatch.setattr(sys, 'argv', ['throughput.py', *TINY_RUN, '--compiled', '--json', str(out)])
    bench.main()
    assert sorted(compiled) == ['VisionTransformer', 'VisionTransformer', 'VisionTransformerHyperBF',
                                'VisionTransformerHyperBF']  # one each for inference and training
    for row in json.loads(out.read_text())['results']:
        ours, vit = row['models']['vit_hyperbf_tiny'], row['models']['timm ViT']
        ratios = [a / b for a, b in zip(ours['compiled']['rounds'], vit['compiled']['rounds'])]
        assert ours['compiled']['throughput_ratio'] == pytest.approx(statistics.median(ratios))
        assert ours['eager']['rounds'] != ours['compiled']['rounds']
    assert 'compiled img/s' in (tmp_path / 'bench.md').read_text()


# one image of vit_qimia_tiny at depth 2: the reads of its four blocks and the output read see 1, 2, 3, 4 and 5
# entries that belong to the image (the position embedding's is shared by the batch), each 65 tokens of a key (64
# channels) and a value (192 channels)
QIMIA_DEPTH2_READ_BYTES = (1 + 2 + 3 + 4 + 5) * 65 * (64 + 192) * 4


def test_read_traffic_counts_the_entries_every_read_takes_in_per_image():
    bench = load_throughput()
    qimia = dict(model_name='vit_qimia_tiny', depth=2)
    assert bench.read_traffic(qimia, (3, 32, 32), amp=False) == QIMIA_DEPTH2_READ_BYTES
    # bf16 autocast: the entries are bf16, half the bytes
    assert bench.read_traffic(qimia, (3, 32, 32), amp=True) == QIMIA_DEPTH2_READ_BYTES / 2
    # block memory of 4: the blocks' reads see 1, 2, 2 and 2 image entries, the output read 2 (patch, summary)
    block = bench.read_traffic(dict(qimia, memory_block_size=4), (3, 32, 32), amp=False)
    assert block == (1 + 2 + 2 + 2 + 2) * 65 * (64 + 192) * 4
    assert bench.read_traffic(dict(qimia, model_name='vit_hyperbf_tiny'), (3, 32, 32), amp=False) == 0


def test_the_roofline_adds_the_reads_bytes_at_bandwidth_to_the_arithmetic():
    roofline = load_throughput().roofline
    # the ViT takes 10 ms an image; 1.25x its arithmetic is 12.5 ms, and 40 MB moved twice at 20 GB/s 4 ms more
    assert roofline(0.8, 40e6, 2, 100., 20e9) == pytest.approx(10 / 16.5)
    assert roofline(0.8, 0., 4, 100., 20e9) == pytest.approx(0.8)


def test_the_copy_bandwidth_is_a_rate_in_bytes_per_second():
    assert 1e8 < load_throughput().copy_bandwidth('cpu') < 1e13


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
    args = type('Args', (), dict(device='cpu', amp=False))()
    assert throughput.peak_memory({'model_name': 'vit_hyperbf_tiny'}, (3, 32, 32), 2, True, False, args) == 123.5
    assert calls[0]['MALLOC_MMAP_THRESHOLD_'] == str(128 * 1024)


def test_a_models_held_memory_is_its_parameters_buffers_and_optimizer_state():
    bench = load_throughput()
    model = timm.create_model('vit_qimia_tiny', depth=1, value_norm='batchnorm')  # BatchNorm: buffers too
    step = bench.make_step(model, torch.randn(2, 3, 32, 32), train=True, amp=False)
    step()
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    assert buffer_bytes > 0
    # AdamW keeps two moments of every parameter and a float32 step count per parameter tensor
    expected = (3 * numel * 4 + 4 * len(params) + buffer_bytes) / 2 ** 20
    assert bench.held_tensor_mib(model, step.optimizer) == pytest.approx(expected)
    inference = bench.make_step(model, torch.randn(2, 3, 32, 32), train=False, amp=False)
    assert inference.optimizer is None
    assert bench.held_tensor_mib(model, None) == pytest.approx((numel * 4 + buffer_bytes) / 2 ** 20)


def test_a_steps_memory_counts_what_the_model_holds_and_the_activations_of_its_batch():
    """Measured in fresh processes: a larger batch costs its activations on top of the same held tensors."""
    bench = load_throughput()
    args = type('Args', (), dict(device='cpu', amp=False))()
    spec = dict(model_name='vit_hyperbf_tiny', depth=2)
    model = timm.create_model(**spec)
    params_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2 ** 20
    small, large = (bench.peak_memory(spec, (3, 32, 32), batch, True, False, args) for batch in (2, 64))
    assert small >= 3 * params_mib  # parameters and AdamW's two moments, whatever the batch
    # 62 more images keep at least their two blocks' MLP hidden activations (65 tokens x 768 channels, float32)
    assert large - small > 62 * 65 * 768 * 4 * 2 / 2 ** 20
