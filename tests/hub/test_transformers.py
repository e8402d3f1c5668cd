"""Repos pushed with ``timm-hbf push`` load in transformers' timm wrapper, both families: ``AutoImageProcessor``,
``AutoModelForImageClassification`` and ``pipeline('image-classification')`` give timm's logits and the label
names of the push."""
import pytest
import timm
import torch
from PIL import Image
from timm.data import create_transform, resolve_model_data_config

from timm_hbf.cli import main

from .conftest import CIFAR10_LABELS, HYPERBF, QIMIA, train_like_train_py

transformers = pytest.importorskip('transformers', reason='transformers is a test extra: pip install -e ".[test]"')
pytestmark = [pytest.mark.slow,  # imports transformers
              pytest.mark.filterwarnings("ignore:Use 'content=<...>' to upload raw bytes:DeprecationWarning")]


@pytest.mark.parametrize('model', [HYPERBF, QIMIA])
def test_auto_classes_and_pipeline_give_timm_s_logits_and_the_label_names(hub, tmp_path, cifar10_sample, model):
    run = train_like_train_py(tmp_path / 'run', model, epochs=1)
    repo = f'transformers/{model}'
    assert main(['push', str(run), '--repo-id', repo, '--label-names', *CIFAR10_LABELS]) == 0
    images = [Image.open(path).convert('RGB') for path in sorted((cifar10_sample / 'test').rglob('*.jpg'))[::20]]

    processor = transformers.AutoImageProcessor.from_pretrained(repo)
    wrapper = transformers.AutoModelForImageClassification.from_pretrained(repo).eval()
    assert type(wrapper).__name__ == 'TimmWrapperForImageClassification'
    assert wrapper.config.id2label == dict(enumerate(CIFAR10_LABELS))
    timm_model = timm.create_model(f'hf-hub:{repo}', pretrained=True).eval()
    transform = create_transform(**resolve_model_data_config(timm_model))
    with torch.no_grad():
        logits = wrapper(**processor(images, return_tensors='pt')).logits
        expected = timm_model(torch.stack([transform(image) for image in images]))
    torch.testing.assert_close(logits, expected)

    top1 = [p[0] for p in transformers.pipeline('image-classification', model=repo)(images, top_k=1)]
    probabilities, classes = expected.softmax(-1).max(-1)
    assert [p['label'] for p in top1] == [CIFAR10_LABELS[i] for i in classes]
    torch.testing.assert_close(torch.tensor([p['score'] for p in top1]), probabilities)
