"""The README's quick start runs as written, with a checkpoint of one's own where it names one, and its results are
those its records measured."""
import json
import re

import timm
import torch

from tests.helpers import ROOT

CHECKPOINT = 'output/train/.../last.pth.tar'  # the README's stand-in for a train.py run's checkpoint


def python_block(section: str) -> str:
    """The first Python code block of the README section titled ``section``."""
    readme = (ROOT / 'README.md').read_text()
    found = re.search(rf'^## {section}\n.*?^```python\n(.*?)^```', readme, flags=re.M | re.S)
    assert found, f'README.md has no Python block under "## {section}"'
    return found[1]


def test_the_quick_start_lists_every_family_loads_every_shipped_model_and_ones_own_checkpoint(tmp_path, capsys):
    code = python_block('Quick start')
    assert CHECKPOINT in code
    trained = timm.create_model('vit_hyperbf_tiny', num_classes=10)
    checkpoint = tmp_path / 'last.pth.tar'
    torch.save({'epoch': 0, 'arch': 'vit_hyperbf_tiny', 'state_dict': trained.state_dict()}, checkpoint)
    scope = {}
    exec(compile(code.replace(CHECKPOINT, str(checkpoint)), 'README.md: Quick start', 'exec'), scope)

    printed = capsys.readouterr().out
    for family in ('vit_hyperbf', 'vit_qimia', 'vit_attnres'):
        assert f"'{family}_tiny'" in printed, family
    assert scope['name'] == timm.list_models(module=['vit_hyperbf', 'vit_qimia'], pretrained=True)[-1]
    features = scope['features'](torch.randn(1, 3, 32, 32))
    assert [f.shape for f in features] == [torch.Size([1, 192, 8, 8])] * 3
    for key, value in trained.state_dict().items():
        assert torch.equal(scope['model'].state_dict()[key], value), key


def test_the_30_epoch_cpu_table_gives_each_run_the_test_top1_its_record_measured():
    readme = (ROOT / 'README.md').read_text().splitlines()
    runs = sorted((ROOT / 'benchmarks' / 'results' / 'cifar10_30ep_cpu' / 'runs').glob('*/test.json'))
    assert len(runs) == 4
    for test_json in runs:
        measured = json.loads(test_json.read_text())
        name = 'timm ViT-Ti, patch 4' if measured['model'] == 'vit_tiny_patch16_224' else f"`{measured['model']}`"
        rows = [line for line in readme if line.startswith(f'| {name} | ') and ' | 30 | ' in line]
        assert any(f"| {measured['top1']:.2f} %" in row for row in rows), test_json.parent.name
