"""examples/classify_cifar10.py on a Hub-ready folder made from a short training run (bf16 weights, as the weights
stage of benchmarks/gpu.py writes them): real CIFAR-10 test images, the class names of config.json, and the
predictions of the weights."""
import tarfile
from pathlib import Path
from typing import Tuple

import pytest
import timm
import torch
import yaml
from PIL import Image
from timm.data import ImageDataset, create_transform, resolve_data_config

from tests.helpers import load_module
from timm_hbf.hub import read_train_output, write_repo_folder

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / 'examples' / 'classify_cifar10.py'
MINI = ROOT.parent / 'shared' / 'datasets' / 'cifar10-mini-jpeg.tar.gz'  # ../shared/datasets/ from the repo root
CIFAR10_LABELS = ['airplane', 'automobile', 'bird', 'cat', 'deer', 'dog', 'frog', 'horse', 'ship', 'truck']

pytestmark = pytest.mark.skipif(not MINI.exists(), reason=f'mini CIFAR-10 archive not found at {MINI}')


def load_script():
    return load_module(SCRIPT)


def train_briefly(data: Path, run_dir: Path) -> Path:
    """vit_hyperbf_tiny (2 blocks), a few AdamW steps on CIFAR-10 training images, saved as train.py saves it
    (checkpoint and args.yaml)."""
    torch.manual_seed(0)
    model = timm.create_model('vit_hyperbf_tiny', depth=2)
    dataset = ImageDataset(str(data / 'train'), transform=create_transform(**resolve_data_config(model=model)))
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(dataset, range(0, len(dataset), 10)), batch_size=25)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for images, targets in loader:
        torch.nn.functional.cross_entropy(model(images), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    run_dir.mkdir(parents=True)
    torch.save(dict(arch='vit_hyperbf_tiny', epoch=0, state_dict=model.state_dict()), run_dir / 'last.pth.tar')
    (run_dir / 'args.yaml').write_text(yaml.safe_dump(dict(model='vit_hyperbf_tiny', model_kwargs=dict(depth=2),
                                                          num_classes=10)))
    return run_dir


@pytest.fixture(scope='module')
def trained(tmp_path_factory) -> Tuple[Path, Path]:
    """A Hub-ready folder of a briefly trained model, written as ``timm-hbf push --dry-run --dtype bfloat16`` writes
    it; and the extracted mini CIFAR-10."""
    root = tmp_path_factory.mktemp('classify')
    with tarfile.open(MINI) as tar:
        tar.extractall(root / 'cifar10', **({'filter': 'data'} if hasattr(tarfile, 'data_filter') else {}))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run = train_briefly(root / 'cifar10', root / 'output' / 'hbf')
    finally:
        torch.set_num_threads(threads)
    folder = write_repo_folder(read_train_output(run), root / 'vit_hyperbf_tiny.c10', 'ORG/vit_hyperbf_tiny.c10',
                               label_names=CIFAR10_LABELS, dtype=torch.bfloat16)
    return folder, root / 'cifar10'


def expected_predictions(folder: Path, data: Path, names) -> list:
    """The class names timm's own loading of the folder predicts for the images ``names`` (``test/CLASS/FILE``),
    read from the extracted files."""
    model = timm.create_model(f'local-dir:{folder}', pretrained=True).eval()
    transform = create_transform(**resolve_data_config(model=model))
    with torch.no_grad():
        logits = model(torch.stack([transform(Image.open(data / name).convert('RGB')) for name in names]))
    return [CIFAR10_LABELS[i] for i in logits.argmax(-1)]


def test_classifies_real_test_images_with_the_folders_weights(trained, capsys):
    folder, data = trained
    results = load_script().main([str(folder), '--data', str(MINI), '--images', '12'])
    names = [r['image'] for r in results]
    # one image of each class in turn, from the test split, each with its own class
    assert [name.split('/')[:2] for name in names] == [['test', c] for c in CIFAR10_LABELS + CIFAR10_LABELS[:2]]
    assert names[0] == 'test/airplane/0000.jpg' and names[10] == 'test/airplane/0001.jpg'
    assert [r['label'] for r in results] == [name.split('/')[1] for name in names]
    assert [r['predicted'] for r in results] == expected_predictions(folder, data, names)
    assert all(0.1 <= r['probability'] <= 1 for r in results)  # the largest of 10 probabilities

    out = capsys.readouterr().out
    assert out.startswith(f'vit_hyperbf_tiny from {folder}')
    correct = sum(r['label'] == r['predicted'] for r in results)
    assert f'{correct} of 12 correct' in out
    assert out.count(' (wrong) |') == 12 - correct
    assert f"| test/ship/0000.jpg | ship | {results[8]['predicted']}" in out


def test_an_extracted_folder_gives_the_images_of_the_archive(trained):
    folder, data = trained
    script = load_script()
    assert script.main([str(folder), '--data', str(data), '--images', '5']) == \
        script.main([str(folder), '--data', str(MINI), '--images', '5'])
