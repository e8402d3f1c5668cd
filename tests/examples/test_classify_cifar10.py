"""examples/classify_cifar10.py, the main job: the sample's test images classified by pretrained models, accuracy per
model and per class, and a picture."""
import json

import pytest
import timm

CLASSES = ['airplane', 'automobile', 'bird', 'cat', 'deer', 'dog', 'frog', 'horse', 'ship', 'truck']


@pytest.mark.slow
def test_the_sample_is_classified_per_model_and_per_class_with_a_picture(example, tmp_path):
    """The shipped weights give the count they were made with (tests/models/test_shipped_weights.py)."""
    (result,) = example('classify_cifar10.py').main(['--models', 'vit_qimia_tiny', '--out', str(tmp_path)])
    assert (result['correct'], result['images'], list(result['per_class'])) == (154, 200, CLASSES)
    assert sum(result['per_class'].values()) / 10 == pytest.approx(result['top1'])  # 20 images of every class
    assert json.loads((tmp_path / 'results.json').read_text())['models'] == [result]
    assert (tmp_path / 'predictions.png').stat().st_size > 10_000


@pytest.mark.parametrize('argv, named', [
    (['--models', 'nonexistent_model'], '--models nonexistent_model: timm knows no such model'),
    (['--models', 'vit_hyperbf_tiny.bogus'], "no tag 'bogus'"),
    (['--models', 'vit_hyperbf_tiny.untrained'], 'tags with weights: vit_hyperbf_tiny.cifar10_100ep'),
    (['--out', 'FILE'], '--out FILE: a file'),
    (['--data', 'FILE'], '--data FILE: neither a folder nor a readable archive'),
    (['--data', 'DIR'], '--data DIR: expected a CIFAR-10 folder'),
])
def test_bad_arguments_exit_with_one_line_naming_them_before_any_model_loads(argv, named, example, tmp_path,
                                                                             monkeypatch, usage_error):
    script = example('classify_cifar10.py')
    file = tmp_path / 'results.txt'
    file.write_text('kept\n')
    monkeypatch.setattr(timm, 'create_model', None)  # a model loaded would fail here
    argv = [arg.replace('FILE', str(file)).replace('DIR', str(tmp_path)) for arg in argv]
    assert named.replace('FILE', str(file)).replace('DIR', str(tmp_path)) in usage_error(lambda: script.main(argv))
    assert file.read_text() == 'kept\n'


def test_a_model_of_other_classes_is_refused_before_anything_is_written(example, cifar10_sample, tmp_path,
                                                                        monkeypatch):
    script = example('classify_cifar10.py')
    five = timm.create_model('vit_hyperbf_tiny', depth=1, num_classes=5)
    reordered = timm.create_model('vit_hyperbf_tiny', depth=1)
    reordered.pretrained_cfg = dict(reordered.pretrained_cfg, label_names=CLASSES[::-1])
    for model, named in ((five, 'predicts 5 classes'), (reordered, r"predicts the classes \['truck'")):
        monkeypatch.setattr(timm, 'create_model', lambda name, pretrained, model=model: model)
        with pytest.raises(SystemExit, match=named):
            script.main(['--models', 'vit_hyperbf_tiny', '--data', str(cifar10_sample), '--out', str(tmp_path / 'o')])
    assert not (tmp_path / 'o').exists()
