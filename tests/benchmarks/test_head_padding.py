"""benchmarks/head_padding.py: the Gaussian attention padded to a multiple of 8 channels against the same attention
unpadded, timed in interleaved rounds, and what either keeps for the backward pass."""
import json
import statistics

import pytest
import torch

from tests.helpers import ROOT, load_module

BENCHMARKS = ROOT / 'benchmarks'


@pytest.fixture(scope='module')
def script():
    """The script as a module."""
    return load_module(BENCHMARKS / 'head_padding.py')


def test_a_run_records_rounds_ratios_and_memory_at_the_models_attention_shape(script, tmp_path):
    out = tmp_path / 'padding.json'
    script.main(['--batch-size', '2', '--rounds', '2', '--steps', '1', '--warmup', '0', '--json', str(out)])
    record = json.loads(out.read_text())
    assert record['attention_shape'] == [2, 3, 65, 64]  # vit_hyperbf_tiny: 3 heads of 64, 64 patches and a class token
    assert record['dtype'] == 'float32'
    assert record['environment']['command'].startswith('python benchmarks/head_padding.py --batch-size 2')
    for mode in ('infer', 'train'):
        rounds = record['seconds_per_call'][mode]
        ratios = [p / u for p, u in zip(rounds['padded'], rounds['unpadded'])]
        assert len(ratios) == 2 and all(r > 0 for r in ratios)
        assert record['time_ratio'][mode] == dict(median=statistics.median(ratios), low=min(ratios), high=max(ratios))
    saved = record['saved_bytes']
    per_head_row = 2 * 3 * 65 * 4  # bytes of one channel of q, k, v or the output, over the batch, heads and tokens
    # the padded call keeps q, k, v and the output 7 channels wider (72 against 65); nothing else differs in size
    assert saved['attention, padded'] - saved['attention, unpadded'] == 4 * 7 * per_head_row
    assert record['padding_share_of_training_memory'] == pytest.approx(
        12 * 4 * 7 * per_head_row / saved['model training step'])


def test_saved_bytes_counts_each_storage_once_and_leaves_the_parameters_out(script):
    x = torch.randn(3, 4, requires_grad=True)
    layer = torch.nn.Linear(4, 5)
    assert script.saved_bytes(lambda: x * x) == x.nbytes  # x saved twice, one storage
    assert script.saved_bytes(lambda: layer(x), layer.parameters()) == x.nbytes  # the weight is the model's
    assert script.saved_bytes(lambda: layer(x)) == x.nbytes + layer.weight.nbytes


@pytest.mark.parametrize('argv, message', [
    (['--model', 'vit_qimia_tiny'], '--model vit_qimia_tiny: its attention is not HyperBF attention'),
    (['--model', 'vit_hyperbf_huge'], '--model vit_hyperbf_huge: Unknown model'),
])
def test_a_model_without_hyperbf_attention_is_refused_by_name(script, argv, message):
    with pytest.raises(SystemExit, match=message):
        script.main(argv)


@pytest.mark.parametrize('argv, message', [
    (['--rounds', '0'], '--rounds must be an integer >= 1, got 0'),
    (['--warmup', '-1'], '--warmup must be an integer >= 0, got -1'),
    (['--device', 'tpu:x'], '--device tpu:x: not a device torch knows'),
    (['--json', '{tmp}'], '--json {tmp}: {tmp} is a folder: name a file'),
])
def test_arguments_it_cannot_use_are_usage_errors_before_anything_is_measured(script, capsys, tmp_path, argv, message):
    argv = [a.format(tmp=tmp_path) for a in argv]
    message = message.format(tmp=tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        script.main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
