"""The model card pushed with a checkpoint: Hub metadata, a usage snippet that works, architecture and paper, the
recipe of args.yaml, the metrics of summary.csv, and the training-curve image."""
import dataclasses
import json
import shutil
import sys

import numpy as np
import pytest
import yaml
from PIL import Image

from timm_hbf.hub import HubError, read_train_output, write_repo_folder
from timm_hbf.hub.model_card import CURVES_FILE, model_card

from .conftest import CIFAR10_LABELS, REPO_ID

TRAIN_BLUE, EVAL_ORANGE = (31, 119, 180), (255, 127, 14)  # matplotlib's tab:blue and tab:orange


def front_matter(card: str) -> dict:
    assert card.startswith('---\n')
    return yaml.safe_load(card.split('---\n')[1])


def section(card: str, title: str) -> str:
    return card.split(f'\n## {title}\n')[1].split('\n## ')[0]


@pytest.fixture(scope='module')
def card(repo_folder) -> str:
    return (repo_folder / 'README.md').read_text()


def test_hub_metadata(card):
    meta = front_matter(card)
    assert meta['library_name'] == 'timm'
    assert {'timm', 'timm_hbf', 'image-classification'} <= set(meta['tags'])
    assert 'transformers' not in meta['tags']  # transformers cannot build the model without timm_hbf
    assert meta['pipeline_tag'] == 'image-classification' and meta['license'] == 'apache-2.0'
    assert f'\n# Model card for {REPO_ID}\n' in card


def test_usage_installs_and_imports_timm_hbf_before_create_model(card):
    usage = section(card, 'Usage')
    assert '```bash\npip install timm-hbf\n```' in usage
    code = usage.split('```python\n')[1].split('```')[0]
    assert code.index('import timm_hbf') < code.index(f"timm.create_model('hf-hub:{REPO_ID}', pretrained=True)")


def test_usage_snippet_runs(card, repo_folder, hub, hub_cache, cifar10_sample, tmp_path, monkeypatch, capsys):
    hub.publish(REPO_ID, {p.name: p.read_bytes() for p in repo_folder.iterdir()})
    monkeypatch.chdir(tmp_path)
    shutil.copy(cifar10_sample / 'test' / 'ship' / '0000.jpg', tmp_path / 'image.jpg')
    exec(section(card, 'Usage').split('```python\n')[1].split('```')[0], {})
    top5 = eval(capsys.readouterr().out)  # [(label, probability), ...]
    assert len(top5) == 5 and {label for label, _ in top5} <= set(CIFAR10_LABELS)
    probabilities = [p for _, p in top5]
    assert probabilities == sorted(probabilities, reverse=True) and 0 < sum(probabilities) <= 1 + 1e-6


def test_architecture_and_paper(card):
    details = section(card, 'Model details')
    assert '`vit_hyperbf_tiny`: HyperBF ViT-Ti' in details and 'Built with `depth=2`.' in details
    assert '**Family:** HyperBF Vision Transformer: "A Homogeneous Transformer Architecture" (Gan & Poggio' in details
    assert '- **Image size:** 32 x 32' in details
    assert f'- **Classes:** 10 ({", ".join(CIFAR10_LABELS)})' in details


def test_recipe_from_args_yaml(card, train_run, cifar10_sample):
    args = yaml.safe_load((train_run / 'args.yaml').read_text())
    recipe = section(card, 'Training recipe')
    for key in ('model_kwargs', 'epochs', 'batch_size', 'opt', 'lr', 'weight_decay', 'sched', 'model_ema',
                'warmup_epochs', 'seed'):  # zero is a value: warmup_epochs 0, seed 0
        assert f'| {key} | `{args[key]}` |' in recipe
    published = yaml.safe_load(recipe.split('```yaml\n')[1].split('```')[0])
    assert published == {k: v for k, v in args.items() if k not in ('data_dir', 'output')}
    assert str(cifar10_sample) not in card and str(train_run.parent) not in card  # paths of the training machine


def results_row(label: str, row: dict) -> str:
    values = [f'{row[k]:.4g}' for k in ('train_loss', 'eval_loss', 'eval_top1', 'eval_top5')]
    return f'| {label} | {row["epoch"]} | {" | ".join(values)} |'


def test_results_from_summary_csv(card, train_run):
    train = read_train_output(train_run)
    pushed = [row for row in train.summary if row['epoch'] == train.epoch][0]
    results = section(card, 'Results')
    assert results_row('this epoch (EMA weights)', pushed) in results  # train.py evaluated the EMA, not these weights
    assert 'these weights' not in results
    assert (results_row('last epoch', train.summary[-1]) in results) == (pushed is not train.summary[-1])
    assert 'The run kept EMA weights (`--model-ema`), and train.py evaluated those: push with `--ema`' in results
    assert f'![Loss and top-1 accuracy per epoch]({CURVES_FILE})' in results


def test_results_show_the_last_epoch_when_the_weights_are_older(train_run):
    train = dataclasses.replace(read_train_output(train_run, ema=True), epoch=0)
    results = section(model_card(REPO_ID, train.create_model(), train), 'Results')
    assert results_row('these weights', train.summary[0]) in results
    assert results_row('last epoch', train.summary[-1]) in results
    assert 'and train.py evaluated those: the weights pushed here.' in results


def test_ema_weights_kept_on_the_cpu_were_not_evaluated(train_run):
    """train.py --model-ema-force-cpu evaluates the plain weights only: the card says whose metrics it shows."""
    plain = read_train_output(train_run)
    for train, pushed in ((plain, 'the weights pushed here.'), (read_train_output(train_run, ema=True),
                                                                 'not of the EMA weights pushed here.')):
        train = dataclasses.replace(train, args=dict(train.args, model_ema_force_cpu=True))
        results = section(model_card(REPO_ID, train.create_model(), train), 'Results')
        assert ('which train.py does not evaluate: the metrics are those of the plain weights, ' + pushed) in results
        assert 'train.py evaluated those' not in results


def test_usage_snippet_asks_for_at_most_as_many_classes_as_the_model_has(train_run):
    train = read_train_output(train_run)
    assert '.topk(5)' in section(model_card(REPO_ID, train.create_model(), train), 'Usage')
    model = train.create_model()
    model.reset_classifier(3)
    assert '.topk(3)' in section(model_card(REPO_ID, model, train), 'Usage')


def test_training_curves_image(repo_folder):
    image = Image.open(repo_folder / CURVES_FILE)
    assert image.format == 'PNG' and image.size == (840, 340)
    pixels = np.asarray(image.convert('RGB'))
    loss, top1 = pixels[:, :420], pixels[:, 420:]

    def drawn(panel, color):
        return int((panel == color).all(-1).sum())

    assert drawn(loss, TRAIN_BLUE) > 100 and drawn(loss, EVAL_ORANGE) > 100  # train and eval loss
    assert drawn(top1, EVAL_ORANGE) > 100 and drawn(top1, TRAIN_BLUE) == 0  # eval top-1 only


def test_run_without_summary_has_no_results(train_run, tmp_path):
    shutil.copy(train_run / 'last.pth.tar', tmp_path)  # args come from the checkpoint itself
    folder = write_repo_folder(read_train_output(tmp_path / 'last.pth.tar'), tmp_path / 'repo', REPO_ID)
    assert sorted(p.name for p in folder.iterdir()) == ['README.md', 'config.json', 'model.safetensors']
    card = (folder / 'README.md').read_text()
    assert '## Training recipe' in card and '## Results' not in card and CURVES_FILE not in card


def test_missing_matplotlib_is_named_and_leaves_no_folder(train_run, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, 'matplotlib.figure', None)  # as if matplotlib were not installed
    with pytest.raises(HubError, match=r'needs matplotlib: pip install "timm-hbf\[hub\]"'):
        write_repo_folder(read_train_output(train_run), tmp_path / 'repo', REPO_ID)
    assert list(tmp_path.iterdir()) == []


def test_label_names_must_match_the_classes(train_run, tmp_path):
    with pytest.raises(HubError, match='3 label names for the 10 classes'):
        write_repo_folder(read_train_output(train_run), tmp_path / 'repo', REPO_ID, label_names=['a', 'b', 'c'])
    assert list(tmp_path.iterdir()) == []


def test_config_holds_what_rebuilds_the_model(repo_folder):
    config = json.loads((repo_folder / 'config.json').read_text())
    assert config['architecture'] == 'vit_hyperbf_tiny' and config['num_classes'] == 10
    assert config['model_args']['depth'] == 2 and config['label_names'] == CIFAR10_LABELS
    # transformers passes the top-level number of classes to timm beside model_args: a second one there is an error
    assert 'num_classes' not in config['model_args'] and config['model_args']['in_chans'] == 3
    assert config['pretrained_cfg']['mean'] == [0.4914, 0.4822, 0.4465]
    # the registry's tag (and the file of its shipped weights) does not describe these weights
    assert 'tag' not in config['pretrained_cfg'] and 'file' not in config['pretrained_cfg']
