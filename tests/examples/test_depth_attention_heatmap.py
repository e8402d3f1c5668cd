"""examples/depth_attention_heatmap.py: the depth-attention matrix of a QIMIA model, drawn from real test images."""

import json
import math

import pytest
import torch


@pytest.fixture
def heatmap_script(load_example):
    return load_example('depth_attention_heatmap.py')


@pytest.mark.parametrize('model, entropy', [
    ('vit_qimia_tiny', [1.] * 5),
    ('vit_attnres_block_tiny', [0.] + [1.] * 4),  # the first read sees one entry, the token embedding
])
def test_untrained_model_reads_uniformly_and_the_heatmap_is_drawn(model, entropy, heatmap_script, cifar10_sample,
                                                                  tmp_path, capsys):
    import matplotlib.image

    out = tmp_path / 'heatmap.png'
    stats = heatmap_script.main([
        '--model', model, '--model-kwargs', 'depth=2', '--data', str(cifar10_sample), '--images', '1000',
        '--out', str(out),
    ])  # more images than the sample has: all of them
    torch.testing.assert_close(stats['entropy'], torch.tensor(entropy))
    assert f'mean entropy {sum(entropy) / 5:.3f} over 5 reads' in capsys.readouterr().out
    image = matplotlib.image.imread(out)
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 300
    assert image[..., :3].std() > .05  # not a blank canvas


def test_the_heatmaps_numbers_are_written_beside_it(heatmap_script, cifar10_sample, tmp_path):
    out = tmp_path / 'heatmap.png'
    stats = heatmap_script.main(['--model', 'vit_qimia_tiny', '--model-kwargs', 'depth=2',
                                 '--data', str(cifar10_sample), '--images', '20', '--out', str(out)])
    record = json.loads(out.with_suffix('.json').read_text())
    assert record['model'] == 'vit_qimia_tiny' and record['images'] == 20
    assert (record['readers'], record['entries']) == (stats['readers'], stats['entries'])
    expected = [[None if math.isnan(v) else pytest.approx(v, abs=1e-4) for v in row]
                for row in stats['matrix'].tolist()]
    assert record['matrix'] == expected and record['matrix'][0][-1] is None  # the first read sees no sublayer's entry
    assert record['entropy'] == pytest.approx(stats['entropy'].tolist(), abs=1e-4)
    assert record['query_norm'] == pytest.approx(stats['query_norm'].tolist(), abs=1e-4)


@pytest.mark.slow
def test_the_pretrained_model_reads_selectively(heatmap_script, cifar10_sample, tmp_path):
    stats = heatmap_script.main(['--model', 'vit_qimia_tiny', '--pretrained', '--data', str(cifar10_sample),
                                 '--images', '32', '--out', str(tmp_path / 'heatmap.png')])
    assert stats['entropy'].mean() < .9  # an untrained model reads uniformly: 1
    # its first read, by the first attention block, leans on the position embedding (measured: 0.6 of its weight)
    assert stats['matrix'][0, stats['entries'].index('pos')] > .5


def test_models_without_depth_attention_are_refused(heatmap_script, cifar10_sample, tmp_path):
    with pytest.raises(SystemExit, match='no depth attention'):
        heatmap_script.main(['--model', 'vit_hyperbf_tiny', '--model-kwargs', 'depth=1', '--data', str(cifar10_sample),
                             '--out', str(tmp_path / 'x.png')])


def test_an_out_without_a_suffix_is_drawn_as_png(heatmap_script, cifar10_sample, tmp_path, capsys):
    """matplotlib adds .png where a name has no suffix: the script names the file it wrote, and the numbers beside."""
    heatmap_script.main(['--model', 'vit_qimia_tiny', '--model-kwargs', 'depth=1', '--data', str(cifar10_sample),
                         '--images', '4', '--out', str(tmp_path / 'heatmap')])
    assert sorted(p.name for p in tmp_path.iterdir()) == ['heatmap.json', 'heatmap.png']
    assert f"heatmap written to {tmp_path / 'heatmap.png'}, its numbers to {tmp_path / 'heatmap.json'}" in \
        capsys.readouterr().out


@pytest.mark.parametrize('argv, message', [
    (['--out', 'OUT/h.json'], '--out OUT/h.json: matplotlib writes no .json picture (it writes .eps, '),
    (['--out', 'OUT/h.txt'], '--out OUT/h.txt: matplotlib writes no .txt picture'),
    (['--out', 'OUT'], '--out OUT: a folder: name a file in it'),
    (['--model', 'nonexistent_model'], '--model nonexistent_model: timm knows no such model'),
    (['--model', 'vit_qimia_tiny.untrained', '--pretrained'],
     '--model vit_qimia_tiny.untrained: vit_qimia_tiny.untrained has no pretrained weights (tags with weights: '),
    (['--checkpoint', 'OUT/missing.pth.tar'], '--checkpoint OUT/missing.pth.tar: no such file'),
    (['--images', '0'], '--images must be an integer >= 1, got 0'),
])
def test_bad_arguments_exit_with_one_line_before_anything_is_computed(argv, message, heatmap_script, tmp_path,
                                                                      monkeypatch, usage_error):
    out = tmp_path / 'pictures.png'  # a folder of that name: no picture can be written there
    out.mkdir()
    argv = [arg.replace('OUT', str(out)) for arg in ['--out', 'OUT/h.png', *argv]]
    monkeypatch.setattr(heatmap_script, 'model_and_test_images', None)  # a computation would fail here
    assert f"error: {message.replace('OUT', str(out))}" in usage_error(lambda: heatmap_script.main(argv))
    assert list(out.iterdir()) == []


def test_block_memory_shows_which_summaries_each_read_sees(heatmap_script, cifar10_sample):
    import timm
    model = timm.create_model('vit_qimia_tiny', depth=2, memory_block_size=2)
    stats = heatmap_script.depth_attention_stats(model, torch.randn(2, 3, 32, 32))
    assert stats['entries'] == ['patch', 'pos', '0.mlp', '1.mlp']  # summaries, named by their newest member
    #                                          patch  pos    0.mlp  1.mlp
    assert stats['matrix'].isfinite().tolist() == [[True, True, False, False],  # 0.attn
                                                   [True, True, True, False],   # 0.mlp: block 0 so far
                                                   [True, True, True, False],   # 1.attn: the finished summary
                                                   [True, True, True, True],    # 1.mlp
                                                   [True, True, True, True]]    # out
    torch.testing.assert_close(stats['matrix'].nansum(1), torch.ones(5))
    torch.testing.assert_close(stats['entropy'], torch.ones(5))
