"""examples/depth_attention_heatmap.py: the depth-attention matrix of a QIMIA or AttnRes model on real test images,
drawn and written beside as JSON."""
import json

import pytest
import timm
import torch


@pytest.mark.parametrize('model, entropy', [
    ('vit_qimia_tiny', [1.] * 5),
    ('vit_attnres_block_tiny', [0.] + [1.] * 4),  # the first read sees one entry, the token embedding
])
def test_an_untrained_model_reads_uniformly_and_the_heatmap_and_its_numbers_are_written(model, entropy, example,
                                                                                         cifar10_sample, tmp_path):
    stats = example('depth_attention_heatmap.py').main([
        '--model', model, '--model-kwargs', 'depth=2', '--data', str(cifar10_sample), '--images', '8',
        '--out', str(tmp_path / 'heatmap')])  # no suffix: .png
    torch.testing.assert_close(stats['entropy'], torch.tensor(entropy))
    assert (tmp_path / 'heatmap.png').stat().st_size > 10_000
    record = json.loads((tmp_path / 'heatmap.json').read_text())
    assert (record['model'], record['images'], record['readers']) == (model, 8, stats['readers'])
    assert record['entropy'] == pytest.approx(entropy, abs=1e-4)
    assert record['matrix'][0][-1] is None  # the first read sees no later sublayer's entry


def test_block_memory_shows_which_summaries_each_read_sees(example):
    model = timm.create_model('vit_qimia_tiny', depth=2, memory_block_size=2)
    stats = example('depth_attention_heatmap.py').depth_attention_stats(model, torch.randn(2, 3, 32, 32))
    assert stats['entries'] == ['patch', 'pos', '0.mlp', '1.mlp']  # summaries, named by their newest member
    assert stats['matrix'].isfinite().sum(1).tolist() == [2, 3, 3, 4, 4]  # 0.attn, 0.mlp, 1.attn, 1.mlp, out
    torch.testing.assert_close(stats['matrix'].nansum(1), torch.ones(5))


@pytest.mark.slow
def test_the_pretrained_model_reads_selectively(example, cifar10_sample, tmp_path):
    stats = example('depth_attention_heatmap.py').main([
        '--model', 'vit_qimia_tiny', '--pretrained', '--data', str(cifar10_sample), '--images', '32',
        '--out', str(tmp_path / 'heatmap.png')])
    assert stats['entropy'].mean() < .9  # an untrained model reads uniformly: 1
    assert stats['matrix'][0, stats['entries'].index('pos')] > .5  # the first read leans on the position embedding


@pytest.mark.parametrize('argv, named', [
    (['--out', 'OUT/h.json'], '--out OUT/h.json: matplotlib writes no .json picture'),
    (['--out', 'OUT'], '--out OUT: a folder'),
    (['--model', 'nonexistent_model'], '--model nonexistent_model: timm knows no such model'),
    (['--model', 'vit_qimia_tiny.untrained', '--pretrained'], 'has no pretrained weights'),
    (['--checkpoint', 'OUT/missing.pth.tar'], '--checkpoint OUT/missing.pth.tar: no such file'),
    (['--images', '0'], '--images must be an integer >= 1, got 0'),
])
def test_bad_arguments_exit_with_one_line_naming_them_before_anything_is_computed(argv, named, example, tmp_path,
                                                                                  monkeypatch, usage_error):
    script = example('depth_attention_heatmap.py')
    monkeypatch.setattr(script, 'model_and_test_images', None)  # a computation would fail here
    out = tmp_path / 'pictures.png'  # a folder: no picture can be written there
    out.mkdir()
    argv = [arg.replace('OUT', str(out)) for arg in ['--out', 'OUT/h.png', *argv]]
    assert named.replace('OUT', str(out)) in usage_error(lambda: script.main(argv))
    assert list(out.iterdir()) == []


def test_a_model_without_depth_attention_is_refused(example, cifar10_sample, tmp_path):
    with pytest.raises(SystemExit, match='vit_hyperbf_tiny has no depth attention'):
        example('depth_attention_heatmap.py').main([
            '--model', 'vit_hyperbf_tiny', '--model-kwargs', 'depth=1', '--data', str(cifar10_sample),
            '--out', str(tmp_path / 'x.png')])
