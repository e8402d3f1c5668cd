"""Every family exports as timm's export scripts build it (``exportable=True``): with ``torch.export``, and to ONNX with
torch's dynamo exporter, run in onnxruntime, with a dynamic batch size, giving torch's logits on real CIFAR-10
images."""
import pytest
import timm
import torch
from torch import nn

from .conftest import DEPTH, MODELS, cifar10_batch, train_step

onnx = pytest.importorskip('onnx', reason='onnx is a test extra: pip install -e ".[test]"')
ort = pytest.importorskip('onnxruntime', reason='onnxruntime is a test extra: pip install -e ".[test]"')
pytest.importorskip('onnxscript', reason="onnxscript (the dynamo ONNX exporter's) is a test extra: "
                                         'pip install -e ".[test]"')

ONNX_TOLERANCE = 1e-4


@pytest.fixture(params=MODELS + ['vit_attnres_tiny'])
def exported_model(request, cifar10_tiny) -> nn.Module:
    """A model built as timm's export scripts build it, after one training step on CIFAR-10 images (so that no
    parameter is at its init, e.g. QIMIA's depth-attention queries at zero), in eval mode."""
    torch.manual_seed(0)
    model = timm.create_model(request.param, num_classes=10, depth=DEPTH, exportable=True)
    train_step(model, model.parameters(), *cifar10_batch(cifar10_tiny / 'train', model))
    return model.eval()


@pytest.fixture
def images(exported_model, cifar10_tiny) -> torch.Tensor:
    """The 20 test images."""
    return cifar10_batch(cifar10_tiny / 'test', exported_model)[0]


def dynamic_batch() -> tuple:
    return ({0: torch.export.Dim('batch')},)


@pytest.mark.slow  # the dynamo exporter takes most of a minute a model
def test_onnx_export_runs_in_onnxruntime_with_a_dynamic_batch(exported_model, images, tmp_path):
    path = tmp_path / 'model.onnx'
    torch.onnx.export(exported_model, (images[:2],), str(path), dynamo=True, input_names=['pixel_values'],
                      output_names=['logits'], dynamic_shapes=dynamic_batch())
    onnx.checker.check_model(str(path))
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=['CPUExecutionProvider'])
    assert isinstance(session.get_inputs()[0].shape[0], str)  # a symbolic batch dimension
    for batch in (images, images[:1]):
        with torch.no_grad():
            expected = exported_model(batch)
        (logits,) = session.run(None, {'pixel_values': batch.numpy()})
        torch.testing.assert_close(torch.from_numpy(logits), expected, rtol=0., atol=ONNX_TOLERANCE)


def test_torch_export_with_a_dynamic_batch(exported_model, images):
    program = torch.export.export(exported_model, (images[:2],), dynamic_shapes=dynamic_batch())
    for batch in (images, images[:1]):
        with torch.no_grad():
            torch.testing.assert_close(program.module()(batch), exported_model(batch))
