"""Repos pushed with ``timm-hbf push`` load in Hugging Face transformers (through its timm wrapper), for both
families: ``AutoImageProcessor``, ``AutoModelForImageClassification`` and ``pipeline('image-classification')``, in a
fresh process, give timm's logits on real CIFAR-10 images and the label names of the push."""
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch
from PIL import Image
from timm.data import create_transform, resolve_model_data_config

from timm_hbf.cli import main

from .conftest import CIFAR10_LABELS, HYPERBF, QIMIA, TOKEN, hub_env, use_hub

pytest.importorskip('transformers', reason='transformers is a test extra: pip install -e ".[test]"')
# huggingface_hub's LFS upload passes bytes as data=, which its HTTP library deprecates: not ours to fix
pytestmark = [pytest.mark.slow,  # a transformers model round trip per test
              pytest.mark.filterwarnings("ignore:Use 'content=<...>' to upload raw bytes:DeprecationWarning")]

CLIENT_SCRIPT = Path(__file__).with_name('transformers_logits.py')
REPOS = {HYPERBF: 'transformers/hbf', QIMIA: 'transformers/qimia'}
EVERY_NTH_IMAGE = 4  # 50 of the 200 test images, 5 per class


@pytest.fixture(scope='module')
def pushed(hub, train_run, qimia_train_run, tmp_path_factory) -> dict:
    """Both training runs pushed with ``timm-hbf push`` (CIFAR-10 label names) to the loopback Hub."""
    hub.reset()
    runs = {HYPERBF: train_run, QIMIA: qimia_train_run}
    with pytest.MonkeyPatch.context() as monkeypatch:
        use_hub(hub, tmp_path_factory.mktemp('push-home'), monkeypatch)
        monkeypatch.setenv('HF_TOKEN', TOKEN)
        for model, repo in REPOS.items():
            assert main(['push', str(runs[model]), '--repo-id', repo, '--label-names', *CIFAR10_LABELS]) == 0
    return REPOS


@pytest.fixture(scope='module')
def images(cifar10_sample) -> list:
    return sorted((cifar10_sample / 'test').rglob('*.jpg'))[::EVERY_NTH_IMAGE]


@pytest.fixture(scope='module')
def transformers_results(hub, pushed, images, tmp_path_factory) -> dict:
    """What ``transformers_logits.py`` saw of every pushed repo, in one fresh process with its own HF_HOME."""
    tmp = tmp_path_factory.mktemp('transformers')
    (tmp / 'images.txt').write_text('\n'.join(map(str, images)))
    command = [sys.executable, str(CLIENT_SCRIPT), str(tmp / 'out.pt'), str(tmp / 'images.txt'), *pushed.values()]
    proc = subprocess.run(command, env=hub_env(hub, tmp / 'home'), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return torch.load(tmp / 'out.pt', weights_only=True)


def timm_logits(repo: str, images: list) -> torch.Tensor:
    """The logits of ``timm.create_model('hf-hub:' + repo)`` on ``images``, preprocessed as its config says."""
    model = timm.create_model(f'hf-hub:{repo}', pretrained=True).eval()
    transform = create_transform(**resolve_model_data_config(model))
    batch = torch.stack([transform(Image.open(path).convert('RGB')) for path in images])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same reduction order as the client's
    try:
        with torch.no_grad():
            return model(batch)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize('model', [HYPERBF, QIMIA])
def test_auto_classes_and_pipeline_give_timms_logits_and_the_label_names(
        model, pushed, transformers_results, images, hub, tmp_path, monkeypatch):
    repo = pushed[model]
    seen = transformers_results[repo]
    assert 'error' not in seen, seen.get('error')
    assert (seen['model_class'], seen['processor_class']) == (
        'TimmWrapperForImageClassification', 'TimmWrapperImageProcessor')
    assert seen['id2label'] == dict(enumerate(CIFAR10_LABELS))
    assert transformers_results['registered_by_the_hook']

    use_hub(hub, tmp_path, monkeypatch)
    expected = timm_logits(repo, images)
    assert expected.shape == (len(images), 10)
    torch.testing.assert_close(seen['logits'], expected)
    probabilities, classes = expected.softmax(-1).max(-1)
    assert seen['pipeline_labels'] == [CIFAR10_LABELS[i] for i in classes]
    torch.testing.assert_close(seen['pipeline_scores'], probabilities)
