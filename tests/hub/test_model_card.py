"""The model card pushed with a checkpoint: the metadata the Hub and timm read, a usage snippet that runs, the recipe
of args.yaml, the metrics of summary.csv and the training curves."""
import shutil
import sys

import pytest
from huggingface_hub import ModelCard
from PIL import Image

from timm_hbf.cli import main
from timm_hbf.hub import HubError, read_train_output, write_repo_folder

from .conftest import CIFAR10_LABELS


def dry_run(run, folder, *options) -> ModelCard:
    assert main(['push', str(run), '--repo-id', 'cifar/hbf', *options, '--dry-run', str(folder)]) == 0
    return ModelCard.load(folder / 'README.md')


def table(card: ModelCard) -> dict:
    """The rows of the card's tables, by their first cell."""
    rows = [[cell.strip(' `') for cell in line.strip('|').split('|')] for line in card.text.splitlines()
            if line.startswith('|')]
    return {row[0]: row[1:] for row in rows}


@pytest.mark.parametrize('ema', [True, False])
def test_metadata_with_the_top1_of_the_weights_train_py_evaluated(train_run, tmp_path, ema):
    """train.py evaluated the EMA weights of this run: their top-1 is the pushed model's, the plain weights have
    none."""
    card = dry_run(train_run, tmp_path / 'repo', *['--ema'] * ema)
    assert (card.data.library_name, card.data.pipeline_tag) == ('timm', 'image-classification')
    assert 'timm_hbf' in card.data.tags
    train = read_train_output(train_run)
    if ema:
        (result,) = card.data.eval_results
        assert result.metric_value == train.summary[train.epoch]['eval_top1']
    else:
        assert card.data.eval_results is None


def test_recipe_and_results(train_run, tmp_path):
    card = dry_run(train_run, tmp_path / 'repo')
    rows, train = table(card), read_train_output(train_run)
    assert rows['lr'] == ['0.001'] and rows['epochs'] == ['3'] and rows['seed'] == ['0']  # 0 is a value
    assert 'data_dir' not in rows and train.args['data_dir'] not in card.text  # a path of the training machine
    pushed, last = [row for key, row in rows.items() if key.split()[:1] in (['0'], ['2'])]
    assert float(pushed[2]) == pytest.approx(train.summary[0]['eval_top1'], rel=1e-3)
    assert float(last[2]) == pytest.approx(train.summary[2]['eval_top1'], rel=1e-3)
    assert Image.open(tmp_path / 'repo' / 'training_curves.png').format == 'PNG'
    assert 'training_curves.png' in card.text


def test_usage_snippet_prints_the_top_classes(train_run, tmp_path, cifar10_sample, monkeypatch, capsys):
    card = dry_run(train_run, tmp_path / 'repo', '--label-names', *CIFAR10_LABELS)
    code = card.text.split('```python\n')[1].split('```')[0]
    assert "'hf-hub:cifar/hbf'" in code
    capsys.readouterr()
    monkeypatch.chdir(tmp_path)
    shutil.copy(cifar10_sample / 'test' / 'ship' / '0000.jpg', tmp_path / 'image.jpg')
    exec(code.replace('hf-hub:cifar/hbf', f'local-dir:{tmp_path / "repo"}'), {})
    top5 = eval(capsys.readouterr().out)
    assert len(top5) == 5 and {label for label, _ in top5} <= set(CIFAR10_LABELS)


def test_a_run_without_summary_has_no_curves(train_run, tmp_path):
    shutil.copy(train_run / 'last.pth.tar', tmp_path)
    card = dry_run(tmp_path / 'last.pth.tar', tmp_path / 'repo')
    assert sorted(p.name for p in (tmp_path / 'repo').iterdir()) == ['README.md', 'config.json', 'model.safetensors']
    assert 'training_curves.png' not in card.text and table(card)['lr'] == ['0.001']


def test_missing_matplotlib_is_named_and_leaves_no_folder(train_run, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, 'matplotlib.figure', None)  # as if matplotlib were not installed
    with pytest.raises(HubError, match=r'timm-hbf\[hub\]'):
        write_repo_folder(read_train_output(train_run), tmp_path / 'repo', 'cifar/hbf')
    assert list(tmp_path.iterdir()) == []
