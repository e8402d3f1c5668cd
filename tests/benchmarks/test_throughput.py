"""benchmarks/throughput.py: our models beside timm's ViT (and MLP-Mixer) of the same size, and HyperBF's attention
layer beside timm's, timed in one run, with the memory of a step measured in fresh processes."""
import json
import os
import subprocess

import pytest
import timm
import torch

from tests.helpers import ROOT, load_module

TINY = ('--batch-size', '2', '--warmup', '1', '--steps', '1', '--rounds', '2', '--threads', '1')


@pytest.fixture
def bench():
    threads = torch.get_num_threads()
    yield load_module(ROOT / 'benchmarks' / 'throughput.py')
    torch.set_num_threads(threads)


@pytest.mark.parametrize('name', ['vit_hyperbf_tiny', 'vit_qimia_tiny', 'vit_attnres_tiny',
                                  'vit_hyperbf_tiny_patch16_224'])
def test_baselines_have_the_candidates_size(bench, name):
    candidate = timm.create_model(name, device='meta')
    dims = bench.dimensions(candidate)
    specs = bench.baselines(dims, mixer=True)
    vit, mixer = (bench.build(spec, 'cpu') for spec in specs.values())
    for baseline, patch_embed in ((vit, vit.patch_embed), (mixer, mixer.stem)):
        assert (baseline.embed_dim, len(baseline.blocks), baseline.num_classes) == \
            (candidate.embed_dim, len(candidate.blocks), candidate.num_classes)
        assert (patch_embed.patch_size, patch_embed.img_size) == \
            (candidate.patch_embed.patch_size, candidate.patch_embed.img_size)
    assert vit.blocks[0].attn.num_heads == dims['num_heads']
    assert vit.blocks[0].mlp.fc1.out_features == mixer.blocks[0].mlp_channels.fc1.out_features == dims['hidden']


def test_the_input_and_the_baseline_follow_the_model_as_built(bench):
    """--model-kwargs img_size=64 (or in_chans) changes the model: its input and its baseline, not only the model."""
    args = bench.parse_args(['--models', 'vit_hyperbf_tiny', '--model-kwargs', 'img_size=64', 'in_chans=1',
                             'depth=1', '--batch-size', '2'])
    ((case, _, specs),) = bench.cases(args)
    assert case == '64/4'
    assert {tuple(spec['input_size']) for spec in specs.values()} == {(1, 64, 64)}
    assert (specs['timm ViT']['img_size'], specs['timm ViT']['in_chans']) == (64, 1)


@pytest.mark.slow
def test_a_run_times_and_measures_every_model_and_variant_beside_the_vit(bench, tmp_path):
    out = tmp_path / 'speed.json'
    rows = bench.main(['--models', 'vit_hyperbf_tiny', '--model-kwargs', 'depth=2', '--variants', 'depth=1', *TINY,
                       '--json', str(out)])
    record = json.loads(out.read_text())
    assert record['results'] == json.loads(json.dumps(rows))
    env = record['environment']
    assert env['command'].endswith(f'--json {out}') and env['torch'] == torch.__version__ and env['date']
    assert env['timm'] == timm.__version__ and env['device']
    assert env['cold_compile'] is False
    assert [r['mode'] for r in rows] == ['infer', 'train']
    for row in rows:
        models = row['models']
        assert list(models) == ['vit_hyperbf_tiny', 'vit_hyperbf_tiny, depth=1', 'timm ViT']
        assert models['vit_hyperbf_tiny, depth=1']['spec']['depth'] == 1 and models['timm ViT']['spec']['depth'] == 2
        for entry in models.values():
            assert len(entry['eager']['rounds']) == 2 and all(r > 0 for r in entry['eager']['rounds'])
            assert entry['eager']['peak_mib'] > 0 and entry['ops_per_step'] > entry['kernels_per_step'] > 0
            assert entry['eager']['first_step_s'] > 0
        full, shallow = models['vit_hyperbf_tiny'], models['vit_hyperbf_tiny, depth=1']
        assert 0.9 < full['ceiling'] < 1.1  # HyperBF units cost the arithmetic of the ViT's
        assert 1.7 < full['macs'] / shallow['macs'] < 2.1  # one block of two: about half the arithmetic
    for label in rows[0]['models']:  # a training step holds gradients and AdamW's moments on top of the weights
        assert rows[1]['models'][label]['eager']['peak_mib'] > rows[0]['models'][label]['eager']['peak_mib']
    assert (tmp_path / 'speed.md').read_text().startswith(f"`{env['command']}`")


@pytest.mark.slow
def test_the_attention_layers_eager_and_compiled(bench):
    """HyperBFAttention beside timm's Attention on a sequence of 16 tokens, a training step eager and compiled (with
    a backend that needs no C++ toolchain); inference: ``test_profile_prints_where_every_model_spends_its_steps``."""
    rows = bench.main(['--attention', '16', '--attention-dim', '128', '--compiled', 'aot_eager', *TINY,
                       '--modes', 'train'])
    assert [(r['case'], r['mode']) for r in rows] == [('16 tokens', 'train')]
    for row in rows:
        assert list(row['models']) == ['HyperBFAttention', 'timm Attention (SDPA)']
        for entry in row['models'].values():
            assert entry['spec']['input_size'] == [16, 128] and entry['spec']['num_heads'] == 2
            for execution in ('eager', 'compiled'):
                assert len(entry[execution]['rounds']) == 2 and entry[execution]['peak_mib'] > 0
                assert entry[execution]['first_step_s'] > 0


@pytest.mark.slow
def test_by_region_times_every_model_with_each_block_compiled_on_its_own(bench):
    rows = bench.main(['--models', 'vit_attnres_tiny', '--model-kwargs', 'depth=2', '--compiled', 'aot_eager',
                       '--by-region', *TINY, '--modes', 'infer'])
    for entry in rows[0]['models'].values():
        assert len(entry['by_region']['rounds']) == 2 and entry['by_region']['peak_mib'] > 0


@pytest.mark.slow
def test_profile_prints_where_every_model_spends_its_steps(bench, capsys):
    """``--profile``: torch.profiler's table for every model and mode measured, naming the attention kernel that
    ran; ``--modes infer`` measures inference alone."""
    rows = bench.main(['--attention', '8', '--attention-dim', '128', *TINY, '--profile', '--modes', 'infer'])
    assert [row['mode'] for row in rows] == ['infer']
    out = capsys.readouterr().out
    for label in ('HyperBFAttention', 'timm Attention (SDPA)'):
        assert f'{label}, eager, infer: the operators and kernels that take the most time in 1 steps' in out
    assert 'eager, train:' not in out
    assert out.count('scaled_dot_product') >= 2 and 'Self CPU time total' in out


@pytest.mark.slow
def test_a_run_stopped_early_keeps_the_cases_it_measured(bench, tmp_path, monkeypatch):
    """The JSON and its table are written after every case: a deadline in the second case keeps the first."""
    measure = bench.measure

    def measure_then_stop(case, *args):
        if case == '16 tokens':
            raise KeyboardInterrupt  # what a deadline's signal ends a run with
        return measure(case, *args)
    monkeypatch.setattr(bench, 'measure', measure_then_stop)
    out = tmp_path / 'attention.json'
    with pytest.raises(KeyboardInterrupt):
        bench.main(['--attention', '8', '16', '--attention-dim', '128', *TINY, '--modes', 'infer', '--json', str(out)])
    rows = json.loads(out.read_text())['results']
    assert [(r['case'], r['mode']) for r in rows] == [('8 tokens', 'infer')]
    assert '| 8 tokens | infer |' in (tmp_path / 'attention.md').read_text()


@pytest.mark.slow
def test_a_steps_memory_counts_what_the_model_holds_and_the_activations_of_its_batch(bench):
    """Measured in fresh processes: a larger batch costs its activations on top of the same held tensors."""
    args = bench.parse_args([])
    spec = dict(model_name='vit_hyperbf_tiny', depth=2, input_size=[3, 32, 32])
    params_mib = sum(p.numel() * p.element_size() for p in bench.build(spec, 'cpu').parameters()) / 2 ** 20
    (small, _), (large, _) = (bench.fresh_process_step(spec, batch, True, None, args) for batch in (2, 64))
    assert small >= 3 * params_mib  # the weights and AdamW's two moments, whatever the batch
    # 62 more images keep at least their two blocks' MLP hidden activations (65 tokens x 768 channels, float32)
    assert large - small > 62 * 65 * 768 * 4 * 2 / 2 ** 20


@pytest.mark.slow
def test_cold_compile_gives_every_process_empty_compiler_caches_of_its_own(bench, monkeypatch):
    """``--cold-compile``: each measuring process compiles from empty caches (a first run), removed afterwards;
    without it, the processes share the caches the timing filled (a rerun)."""
    seen = []

    def run(cmd, env, **kwargs):
        cache, triton = env.get('TORCHINDUCTOR_CACHE_DIR'), env.get('TRITON_CACHE_DIR')
        seen.append((cache, triton, cache is not None and os.path.isdir(cache) and os.listdir(cache) == []))
        return subprocess.CompletedProcess(cmd, 0, stdout='12.5 3.25\n')
    monkeypatch.setattr(bench.subprocess, 'run', run)
    spec = dict(model_name='vit_hyperbf_tiny', depth=1, input_size=[3, 32, 32])
    for cold in (True, True, False):
        args = bench.parse_args(['--compiled'] + (['--cold-compile'] if cold else []))
        assert bench.fresh_process_step(spec, 2, True, 'inductor', args) == (12.5, 3.25)
    (first, first_triton, first_empty), (second, second_triton, second_empty), (warm, warm_triton, _) = seen
    assert first_empty and second_empty and first != second and not os.path.exists(first)
    assert first_triton.startswith(first) and second_triton.startswith(second)
    # the caches the timing in this process used, whatever they hold (an empty folder on a fresh machine)
    assert (warm, warm_triton) == (os.environ.get('TORCHINDUCTOR_CACHE_DIR'), os.environ.get('TRITON_CACHE_DIR'))


@pytest.mark.parametrize('variant', ['memory_block_size', '=1', 'depth=1,=2'])
def test_variants_must_be_key_value_pairs(bench, capsys, variant):
    with pytest.raises(SystemExit):
        bench.parse_args(['--variants', variant])
    assert f'--variants takes KEY=VALUE[,KEY=VALUE] items, got {variant}' in capsys.readouterr().err


@pytest.mark.parametrize('argv, message', [
    (['--models', 'nonexistent_model'], '--models nonexistent_model: timm knows no such model (see timm.list_models('
                                        "module=['vit_hyperbf', 'vit_qimia', 'vit_attnres']) for ours)"),
    (['--json', 'DIR'], '--json DIR: DIR is a folder: name a file'),
    (['--json', 'DIR/../speed.md'], '--json DIR/../speed.md: the table goes beside it as DIR/../speed.md, and would '
                                    'overwrite it: name a .json file'),
    (['--json', 'FILE/speed.json'], '--json FILE/speed.json: FILE is a file, not a folder'),
    (['--rounds', '0'], '--rounds must be an integer >= 1, got 0'),
    (['--batch-size', '0'], '--batch-size must be an integer >= 1, got 0'),
    (['--model-kwargs', 'depth'], "argument --model-kwargs: takes KEY=VALUE items, got 'depth'"),
    (['--device', 'gpu'], '--device gpu: not a device torch knows ('),
])
def test_bad_arguments_exit_with_one_line(bench, capsys, tmp_path, argv, message):
    """Checked as the arguments are read: a --json that cannot be written once failed after the first case had been
    measured, losing it."""
    (tmp_path / 'notes.txt').write_text('kept\n')

    def paths(text: str) -> str:
        return text.replace('DIR', str(tmp_path)).replace('FILE', str(tmp_path / 'notes.txt'))
    with pytest.raises(SystemExit):
        bench.parse_args([paths(arg) for arg in argv])
    assert f'error: {paths(message)}' in capsys.readouterr().err.strip().splitlines()[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ['notes.txt']


@pytest.mark.parametrize('argv, message', [
    (['--variants', 'bogus=1'], "--variants bogus=1: vit_hyperbf_tiny does not take it (VisionTransformer.__init__() "
                                "got an unexpected keyword argument 'bogus')"),
    (['--variants', 'depth=1', 'mlp_normalized=True,bogus=1'],
     '--variants mlp_normalized=True,bogus=1: vit_hyperbf_tiny does not take it ('),
    (['--model-kwargs', 'bogus=1'], '--model-kwargs bogus=1: vit_hyperbf_tiny does not take it ('),
    (['--models', 'vit_hyperbf_tiny.bogus'],
     "--models vit_hyperbf_tiny.bogus: vit_hyperbf_tiny has no pretrained tag 'bogus'. Tags with weights: "),
])
def test_a_model_that_cannot_be_built_exits_with_one_line_before_anything_is_measured(bench, monkeypatch, argv,
                                                                                      message):
    """Every candidate and variant is built on the meta device first: an argument the model does not take once ended
    in the constructor's TypeError, after the cases before it had been measured."""
    monkeypatch.setattr(bench, 'measure', None)  # measuring would fail here
    with pytest.raises(SystemExit) as exit_info:
        bench.main(['--models', 'vit_hyperbf_tiny', *argv, *TINY])
    assert str(exit_info.value.code).startswith(message) and '\n' not in str(exit_info.value.code)
