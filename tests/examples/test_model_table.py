"""examples/model_table.py on the repository's CIFAR-10 sample: it lists every model of ours, and gives each a sensible
row."""
import re

import pytest
import timm
import torch

from tests.helpers import ROOT, load_module

SCRIPT = ROOT / 'examples' / 'model_table.py'
ROW = re.compile(r'^\| `(\w+)` \| ([\d.]+) \| ([\d.]+) \| (\d+x\d+) \|(?: ([\d.]+) \| ([\d.]+) \|)?$')


def load_script():
    return load_module(SCRIPT)


def table_rows(text: str) -> dict:
    return {m[1]: m.groups()[1:] for m in map(ROW.match, text.splitlines()) if m}


@pytest.fixture
def one_thread():
    """One CPU thread: a checks-only run, and far steadier than two threads on a busy machine."""
    threads = torch.get_num_threads()
    yield ['--threads', '1']
    torch.set_num_threads(threads)


def test_the_default_lists_every_model_of_ours():
    names = load_script().model_names()
    assert names == timm.list_models(module=['vit_hyperbf', 'vit_qimia'])
    assert set(timm.list_models('vit_hyperbf*')) | set(timm.list_models('vit_qimia*')) <= set(names)


# a model of each family module at each input size: the others are their code at other widths and options
ONE_OF_EACH = ['vit_hyperbf_tiny', 'vit_attnres_block_tiny', 'vit_hyperbf_tiny_patch16_224',
               'vit_qimia_tiny_patch16_224']


def test_model_table(capsys, one_thread, cifar10_sample):
    script = load_script()
    script.main(['--data', str(cifar10_sample), '--models', *ONE_OF_EACH, '--limit', '20', '--limit-224', '4',
                 '--batch-size', '10', *one_thread])
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert sorted(rows) == sorted(ONE_OF_EACH)
    for name, (params, gmacs, size, img_s, top1) in rows.items():
        assert float(params) > 0 and float(gmacs) > 0, name
        assert size == ('224x224' if '224' in name else '32x32'), name
        assert float(img_s) > 0, name
        assert float(top1) % (25 if '224' in name else 5) == 0, name  # a share of 4 or 20 images
    assert '200 images' in out and '20 at 32x32' in out and '4 at 224x224' in out
    assert 'untrained' in out and 'Total wall time' in out


def test_markdown_only(capsys, one_thread):
    script = load_script()
    rows = script.main(['--markdown-only', '--models', 'vit_hyperbf_tiny', 'vit_hyperbf_tiny_patch16_224', *one_thread])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == '| model | params (M) | GMACs | input |'
    assert [r['model'] for r in rows] == ['vit_hyperbf_tiny', 'vit_hyperbf_tiny_patch16_224']
    assert len(lines) == 4 and all(ROW.match(line) for line in lines[2:])


def test_gmacs_count_attention_as_timm_publishes_them():
    """timm lists vit_tiny_patch16_224 at 1.26 GMACs, 0.18 of them attention's two products."""
    model = timm.create_model('vit_tiny_patch16_224').eval()
    assert load_script().count_gmacs(model, (3, 224, 224), torch.device('cpu')) == pytest.approx(1.26, abs=.01)


def test_by_default_reads_the_repositorys_sample(capsys, one_thread):
    load_script().main(['--models', 'vit_hyperbf_tiny', '--limit', '10', *one_thread])
    out = capsys.readouterr().out
    assert 'test split, 200 images' in out and '10 at 32x32' in out
    assert set(table_rows(out)) == {'vit_hyperbf_tiny'}


def test_data_without_the_split_names_the_fix(tmp_path, one_thread):
    with pytest.raises(FileNotFoundError, match=r'--data .*: no test/ folder .*ImageFolder layout'):
        load_script().main(['--data', str(tmp_path), '--models', 'vit_hyperbf_tiny', *one_thread])
