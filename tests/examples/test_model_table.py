"""examples/model_table.py runs: a row of parameters, GMACs, input size, speed and top-1 for a model on the sample."""


def test_a_model_gets_its_row(example, capsys):
    (row,) = example('model_table.py').main(['--models', 'vit_hyperbf_tiny', '--limit', '10', '--threads', '1'])
    assert (row['model'], row['input'], row['images']) == ('vit_hyperbf_tiny', '32x32', 10)
    assert row['params'] > 0 and row['gmacs'] > 0 and row['img_s'] > 0 and 0 <= row['top1'] <= 100
    assert '| `vit_hyperbf_tiny` |' in capsys.readouterr().out
