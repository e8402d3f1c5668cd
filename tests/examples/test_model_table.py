"""examples/model_table.py on the repository's CIFAR-10 sample: it lists every model of ours, gives each a sensible
row, and the README's model table gives what it counts."""
import re

import pytest
import timm
import torch

from tests.helpers import ROOT

SAMPLE = ROOT / 'data' / 'cifar10-mini-jpeg.tar.gz'
ROW = re.compile(r'^\| `(\w+)` \| ([\d.]+) \| ([\d.]+) \| (\d+x\d+) \|(?: ([\d.]+) \| ([\d.]+) \|)?$')


@pytest.fixture(scope='module')
def script(load_example):
    return load_example('model_table.py')


def table_rows(text: str) -> dict:
    return {m[1]: m.groups()[1:] for m in map(ROW.match, text.splitlines()) if m}


@pytest.fixture
def one_thread():
    """One CPU thread: a checks-only run, and far steadier than two threads on a busy machine."""
    threads = torch.get_num_threads()
    yield ['--threads', '1']
    torch.set_num_threads(threads)


def test_the_default_lists_every_model_of_ours(script):
    names = script.model_names()
    assert names == timm.list_models(module=['vit_hyperbf', 'vit_qimia', 'vit_attnres'])
    assert set(timm.list_models('vit_hyperbf*')) | set(timm.list_models('vit_qimia*')) <= set(names)


# a model of each family module at each input size: the others are their code at other widths and options
ONE_OF_EACH = ['vit_hyperbf_tiny', 'vit_attnres_block_tiny', 'vit_hyperbf_tiny_patch16_224',
               'vit_qimia_tiny_patch16_224']


@pytest.mark.slow
def test_model_table(capsys, one_thread, cifar10_sample, script):
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


def readme_model_table() -> dict:
    """The README's model table as {name: (params, GMACs, input, pretrained tag)}. Its rows name several models in two
    shorthands: `a`, `b` (one value for each) and `a_{x,y}_b` (the values `1 / 2` in the order of the braces)."""
    rows = {}
    for line in (ROOT / 'README.md').read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip('|').split('|')]
        if len(cells) != 6 or not re.fullmatch(r'\d+x\d+', cells[3]):
            continue
        names = []
        for pattern in re.findall(r'`([^`]+)`', cells[0]):
            braces = re.search(r'\{([^}]*)\}', pattern)
            names += [pattern[:braces.start()] + part + pattern[braces.end():] for part in braces[1].split(',')] \
                if braces else [pattern]
        params, gmacs = (cell.split(' / ') for cell in cells[1:3])
        for i, name in enumerate(names):
            assert name not in rows, f'README.md lists {name} twice'
            rows[name] = (params[i if len(params) > 1 else 0], gmacs[i if len(gmacs) > 1 else 0], cells[3],
                          cells[4].strip('`'))
    return rows


def test_the_readme_table_lists_every_model_of_ours_with_the_tag_of_its_weights(script):
    """A model with weights is listed with its default tag (the one ``pretrained=True`` loads), one without none."""
    rows = readme_model_table()
    assert sorted(rows) == sorted(script.model_names())
    for name, (*_, tag) in rows.items():
        cfg = timm.models.get_pretrained_cfg(name)
        assert tag == (cfg.tag if cfg.has_weights else ''), name


@pytest.mark.slow
def test_markdown_only_gives_the_readmes_params_and_gmacs(capsys, one_thread, script):
    """The README's rows of the tiny models are what ``--markdown-only`` prints (the larger ones are their code at
    other widths, and take a minute to count)."""
    tiny = [name for name in script.model_names() if '_tiny' in name]
    rows = script.main(['--markdown-only', '--models', *tiny, *one_thread])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == '| model | params (M) | GMACs | input |'
    assert sorted(r['model'] for r in rows) == sorted(tiny)
    assert len(lines) == len(tiny) + 2 and all(ROW.match(line) for line in lines[2:])
    readme = readme_model_table()
    assert {name: values for name, *values in (ROW.match(line).groups()[:4] for line in lines[2:])} == \
        {name: list(readme.get(name, ['not in README.md'])[:3]) for name in tiny}


def test_gmacs_count_attention_as_timm_publishes_them(script):
    """timm lists vit_tiny_patch16_224 at 1.26 GMACs, 0.18 of them attention's two products."""
    model = timm.create_model('vit_tiny_patch16_224').eval()
    assert script.count_gmacs(model, (3, 224, 224), torch.device('cpu')) == pytest.approx(1.26, abs=.01)


def test_by_default_reads_the_repositorys_sample(capsys, one_thread, script):
    script.main(['--models', 'vit_hyperbf_tiny', '--limit', '10', *one_thread])
    out = capsys.readouterr().out
    assert 'test split, 200 images' in out and '10 at 32x32' in out
    assert set(table_rows(out)) == {'vit_hyperbf_tiny'}


def test_data_without_the_split_names_the_fix(tmp_path, one_thread, script, usage_error):
    message = usage_error(lambda: script.main(['--data', str(tmp_path), '--models', 'vit_hyperbf_tiny', *one_thread]))
    assert message.startswith(f'--data {tmp_path}: no test/ folder in it or in a folder of it. Give a CIFAR-10 folder')


def test_an_archive_without_the_split_is_named_not_the_folder_it_was_extracted_to(script, one_thread, usage_error):
    message = usage_error(lambda: script.main(['--split', 'nosplit', '--models', 'vit_hyperbf_tiny', *one_thread]))
    assert message.startswith(f'--data {SAMPLE}: no nosplit/ folder in it')


@pytest.mark.parametrize('argv, message', [
    (['--models', 'nonexistent_model'],
     "--models nonexistent_model: timm knows no such model (see timm.list_models(module="
     "['vit_hyperbf', 'vit_qimia', 'vit_attnres'])"),
    (['--models', 'vit_hyperbf_tiny.bogus'], "--models vit_hyperbf_tiny.bogus: vit_hyperbf_tiny has no tag 'bogus'"),
    (['--limit', '0'], '--limit must be an integer >= 1, got 0'),
    (['--batch-size', '0'], '--batch-size must be an integer >= 1, got 0'),
    (['--device', 'bogus'], '--device bogus: Expected one of cpu, cuda, '),
    (['--data', 'missing_dir'], '--data missing_dir: no such file or folder'),
    (['--data', 'FILE'], '--data FILE: neither a folder nor a readable archive. Give a CIFAR-10 folder or .tar.gz'),
])
def test_bad_arguments_exit_with_one_line_before_any_model_is_built(argv, message, script, tmp_path, monkeypatch,
                                                                    usage_error):
    file = tmp_path / 'notes.txt'
    file.write_text('not an archive\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(timm, 'create_model', None)  # a model built would fail here
    argv = [arg.replace('FILE', str(file)) for arg in ['--models', 'vit_hyperbf_tiny', *argv]]
    assert f"error: {message.replace('FILE', str(file))}" in usage_error(lambda: script.main(argv))
