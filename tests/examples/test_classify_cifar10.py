"""examples/classify_cifar10.py, the main job: real CIFAR-10 test images classified by pretrained models, accuracy
per model and per class, and a picture."""
import json
import shutil
from itertools import combinations
from pathlib import Path

import pytest
import timm
import torch
import yaml
from timm.data import ImageDataset, create_transform, resolve_data_config

from timm_hbf.hub import read_train_output, write_repo_folder

CLASSES = ['airplane', 'automobile', 'bird', 'cat', 'deer', 'dog', 'frog', 'horse', 'ship', 'truck']


@pytest.fixture(scope='module')
def script(load_example):
    return load_example('classify_cifar10.py')


@pytest.fixture(scope='module')
def hub_folder(cifar10_sample, tmp_path_factory) -> Path:
    """A Hub-ready folder (bf16 weights, as ``timm-hbf push --dry-run --dtype bfloat16`` writes it) of a 2-block
    vit_hyperbf_tiny trained for a few steps on the sample's training images."""
    root = tmp_path_factory.mktemp('classify')
    torch.manual_seed(0)
    model = timm.create_model('vit_hyperbf_tiny', depth=2)
    train = ImageDataset(str(cifar10_sample / 'train'), transform=create_transform(**resolve_data_config(model=model)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for images, targets in torch.utils.data.DataLoader(torch.utils.data.Subset(train, range(0, 1000, 5)), 50):
        torch.nn.functional.cross_entropy(model(images), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    run = root / 'run'
    run.mkdir()
    torch.save(dict(arch='vit_hyperbf_tiny', epoch=0, state_dict=model.state_dict()), run / 'last.pth.tar')
    (run / 'args.yaml').write_text(yaml.safe_dump(dict(model='vit_hyperbf_tiny', model_kwargs=dict(depth=2))))
    return write_repo_folder(read_train_output(run / 'last.pth.tar'), root / 'hub', 'ORG/NAME', label_names=CLASSES,
                             dtype=torch.bfloat16)


@pytest.mark.slow
def test_the_sample_is_classified_per_model_and_per_class_with_a_picture(hub_folder, tmp_path, capsys, script):
    name = f'local-dir:{hub_folder}'
    results = script.main(['--models', name, '--out', str(tmp_path)])

    (result,) = results
    assert result['images'] == 200 and list(result['per_class']) == CLASSES
    assert result['top1'] == pytest.approx(100. * result['correct'] / 200)
    assert sum(result['per_class'].values()) / 10 == pytest.approx(result['top1'])  # 20 images of every class
    out = capsys.readouterr().out
    assert f"**{result['top1']:.2f}** ({result['correct']}/200)" in out
    assert (tmp_path / 'predictions.png').stat().st_size > 10_000
    assert (tmp_path / 'results.json').is_file()


@pytest.mark.slow
def test_by_default_every_shipped_model_at_its_most_accurate_weights(script):
    names = script.shipped_models()
    architectures = timm.list_models(module=['vit_hyperbf', 'vit_qimia', 'vit_attnres'], pretrained=True,
                                     include_tags=False)
    in_the_package = [arch for arch in architectures if timm.models.get_pretrained_cfg(arch).file]
    assert [name.split('.')[0] for name in names] == in_the_package and len(in_the_package) >= 5
    for name in names:
        architecture, tag = name.split('.')
        assert timm.create_model(architecture, pretrained=True).pretrained_cfg['tag'] == tag, name


@pytest.mark.slow
def test_an_extracted_folder_gives_the_counts_of_timms_own_loading_of_the_weights(hub_folder, cifar10_sample, tmp_path,
                                                                                    script):
    name = f'local-dir:{hub_folder}'
    (result,) = script.main(['--models', name, '--data', str(cifar10_sample), '--out', str(tmp_path)])
    model = timm.create_model(name, pretrained=True).eval()
    test = ImageDataset(str(cifar10_sample / 'test'), transform=create_transform(**resolve_data_config(model=model)))
    images, labels = zip(*test)
    with torch.no_grad():
        correct = (model(torch.stack(images)).argmax(-1) == torch.tensor(labels)).sum().item()
    assert result['correct'] == correct
    (tmp_path / 'data').mkdir()
    (tmp_path / 'data' / 'cifar10').symlink_to(cifar10_sample)  # an archive's one top-level folder, extracted
    (again,) = script.main(['--models', name, '--data', str(tmp_path / 'data'), '--out', str(tmp_path)])
    assert again['correct'] == correct


@pytest.fixture(scope='module')
def sample_predictions(cifar10_sample, script) -> dict:
    """Labels, file names and predictions of the sample's test split, as ``predict`` gives them."""
    model = timm.create_model('vit_hyperbf_tiny', depth=1, num_classes=10).eval()
    return script.predict(model, cifar10_sample / 'test')


@pytest.mark.slow
@pytest.mark.parametrize('models', [5, 8])  # the default's number, and more
def test_the_picture_holds_every_text_of_any_number_of_models_apart_and_inside(cifar10_sample, sample_predictions,
                                                                                 models, script):
    """Nothing drawn overlaps: every image's class and predictions, the list of the models, the confusion matrices'
    titles and labels, each whole inside the picture, for any number of models."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # a test extra, as the picture's matplotlib

    out = sample_predictions
    torch.manual_seed(0)
    results = [dict(out, model=f'vit_hyperbf_nrbf_tiny_patch16_224.cifar10_100ep_{k}', top1=100. * k / models,
                    predictions=torch.where(torch.rand(200) < .5, out['labels'], torch.randint(0, 10, (200,))))
               for k in range(models)]
    fig = script.picture(results, cifar10_sample / 'test', CLASSES)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    texts = list(fig.texts)
    for ax in fig.axes:
        texts += [ax.title, ax.xaxis.label, *ax.get_xticklabels(), *ax.get_yticklabels()] if ax.axison else [ax.title]
    texts = [t for t in texts if t.get_text().strip()]
    assert len(texts) > 30 * (models + 1)
    boxes = {t: t.get_window_extent(canvas.get_renderer()) for t in texts}
    outside = [t.get_text() for t, box in boxes.items() if not fig.bbox.contains(box.x0, box.y0)
               or not fig.bbox.contains(box.x1, box.y1)]
    assert not outside
    overlapping = [(a.get_text(), b.get_text()) for a, b in combinations(texts, 2) if boxes[a].overlaps(boxes[b])]
    assert not overlapping


def test_data_without_a_test_split_is_named(tmp_path, script):
    with pytest.raises(SystemExit, match=f'--data {tmp_path}: expected a CIFAR-10 folder or .tar.gz archive'):
        script.main(['--models', 'vit_hyperbf_tiny', '--data', str(tmp_path), '--out', str(tmp_path)])


def test_a_model_of_other_classes_is_refused_before_anything_is_written(cifar10_sample, tmp_path, monkeypatch,
                                                                        script):
    five = timm.create_model('vit_hyperbf_tiny', depth=1, num_classes=5)
    reordered = timm.create_model('vit_hyperbf_tiny', depth=1)
    reordered.pretrained_cfg = dict(reordered.pretrained_cfg, label_names=CLASSES[::-1])
    for model, message in ((five, r"vit_qimia_tiny predicts 5 classes, not the data's \['airplane', .*name a CIFAR-10"),
                           (reordered, r"vit_qimia_tiny predicts the classes \['truck', ")):
        monkeypatch.setattr(timm, 'create_model', lambda name, pretrained, model=model: model)
        with pytest.raises(SystemExit, match=message):
            script.main(['--models', 'vit_qimia_tiny', '--data', str(cifar10_sample), '--out', str(tmp_path / 'out')])
    assert not (tmp_path / 'out').exists()


@pytest.mark.parametrize('argv, message', [
    (['--models', 'vit_hyperbf_tiny', 'nonexistent_model'],
     "--models nonexistent_model: timm knows no such model (see timm.list_models(module="
     "['vit_hyperbf', 'vit_qimia', 'vit_attnres'])"),
    (['--models', 'vit_hyperbf_tiny.bogus'], "--models vit_hyperbf_tiny.bogus: vit_hyperbf_tiny has no tag 'bogus'"),
    (['--models', 'vit_hyperbf_tiny.untrained'],
     '--models vit_hyperbf_tiny.untrained: vit_hyperbf_tiny.untrained has no pretrained weights (tags with weights: '
     'vit_hyperbf_tiny.cifar10_100ep'),
    (['--out', 'FILE'], '--out FILE: a file, not a folder'),
    (['--out', 'FILE/results'], '--out FILE/results: FILE is a file, not a folder'),
    (['--data', 'FILE'], '--data FILE: neither a folder nor a readable archive'),
])
def test_bad_arguments_exit_with_one_line_before_any_model_is_evaluated(argv, message, script, tmp_path, monkeypatch,
                                                                        usage_error):
    """An --out that cannot be written once was found only after every model had been evaluated."""
    file = tmp_path / 'results.txt'
    file.write_text('kept\n')
    monkeypatch.setattr(timm, 'create_model', None)  # a model loaded would fail here
    argv = [arg.replace('FILE', str(file)) for arg in ['--models', 'vit_hyperbf_tiny', *argv]]
    assert f"error: {message.replace('FILE', str(file))}" in usage_error(lambda: script.main(argv))
    assert file.read_text() == 'kept\n'


def test_weights_that_do_not_fit_exit_with_one_line(script, hub_folder, tmp_path, usage_error):
    """timm-hbf's checked loading names what does not fit: here a config that names another architecture."""
    folder = shutil.copytree(hub_folder, tmp_path / 'hub')
    config = json.loads((folder / 'config.json').read_text())
    (folder / 'config.json').write_text(json.dumps(dict(config, architecture='vit_qimia_tiny')))
    message = usage_error(lambda: script.main(['--models', f'local-dir:{folder}', '--out', str(tmp_path / 'out')]))
    assert message.startswith(f'--models local-dir:{folder}: {folder} does not fit vit_qimia_tiny as built: ')
    assert not (tmp_path / 'out').exists()
