"""The wheel as a user installs it: built from the repository, checked for the weights it ships and its size, and
installed (not editable) in a new virtual environment outside the repository, where the README's quick start, every
default tag's weights offline, ``timm-hbf push --dry-run`` and timm's validate.py run.

The environment sees torch, timm and the rest of this one's packages; timm_hbf comes from the wheel alone
(``wheel_env``, tests/conftest.py). timm's validate.py is in timm's git repository only (neither timm's wheel nor its
sdist ships it): ``TIMM_HBF_TIMM_SCRIPTS`` names a folder holding the validate.py of the timm version under test
(e.g. a clone of pytorch-image-models at its tag). Without it (the package index has no validate.py), the same
evaluation runs with the timm functions validate.py calls (``create_dataset``, ``create_loader``).
"""
import json
import os
import re
import shutil
import zipfile
from pathlib import Path, PurePosixPath
from typing import Dict, List, Tuple

import pytest
import timm
import torch
import yaml
from safetensors.torch import load_file
from timm.models import get_pretrained_cfg
from timm.utils import update_summary

import timm_hbf
from tests.helpers import ROOT, run_in

pytestmark = pytest.mark.slow  # builds the wheel and installs it

FAMILIES = ['vit_hyperbf', 'vit_qimia', 'vit_attnres']  # timm's module names of our models
MAX_WHEEL_BYTES = 60 * 10 ** 6
SCRIPTS_VARIABLE = 'TIMM_HBF_TIMM_SCRIPTS'  # a folder holding timm's validate.py
MIN_SAMPLE_TOP1 = 50.  # percent of the sample's 200 test images, far above chance (10 %)
OFFLINE = dict(HF_HUB_OFFLINE='1')


def default_weights() -> Dict[str, str]:
    """Every model of ours whose default tag has weights of our own, and that tag's file, from timm's registry (the
    AttnRes models built on timm's ViTs default to timm's weights on the Hub)."""
    cfgs = {name: get_pretrained_cfg(name) for name in timm.list_models(module=FAMILIES)}
    return {name: cfg.file for name, cfg in cfgs.items()
            if (cfg.file or cfg.url or cfg.hf_hub_id) and not (cfg.hf_hub_id or '').startswith('timm/')}


DEFAULT_WEIGHTS = default_weights()


def test_every_default_tag_has_a_file_of_the_package_or_is_timms_own_weights():
    assert DEFAULT_WEIGHTS, f'no model of {FAMILIES} has weights in its default tag'
    package = Path(timm_hbf.__file__).resolve().parent
    elsewhere = {name: file for name, file in DEFAULT_WEIGHTS.items()
                 if not (file and Path(file).resolve().parent == package / 'weights')}
    assert not elsewhere, f'default tags whose weights are no file of timm_hbf/weights/: {elsewhere}'
    timms = [name for name in timm.list_models(module=FAMILIES) if name not in DEFAULT_WEIGHTS
             and get_pretrained_cfg(name).hf_hub_id]
    assert timms and all(get_pretrained_cfg(name).hf_hub_id.startswith('timm/') for name in timms)


def test_the_wheel_ships_each_default_tags_weights_and_no_others_in_at_most_60_mb(built_wheel):
    with zipfile.ZipFile(built_wheel) as wheel:
        shipped = {PurePosixPath(n).name: wheel.getinfo(n).file_size for n in wheel.namelist()
                   if PurePosixPath(n).parent == PurePosixPath('timm_hbf/weights')}
    expected = {Path(file).name for file in DEFAULT_WEIGHTS.values()}
    assert not expected - set(shipped), f'default tags whose weights the wheel lacks: {sorted(expected - set(shipped))}'
    assert not set(shipped) - expected, ('weights in the wheel that no default tag loads (superseded tags leave the '
                                         f'package): {sorted(set(shipped) - expected)}')
    assert all(size > 2 ** 20 for size in shipped.values()), f'weights files of a few bytes (LFS pointers?): {shipped}'
    size = built_wheel.stat().st_size
    assert size <= MAX_WHEEL_BYTES, f'{built_wheel.name} takes {size / 1e6:.1f} MB, more than 60 MB'


def test_the_wheel_is_of_the_packages_version(built_wheel):
    assert built_wheel.name.startswith(f'timm_hbf-{timm_hbf.__version__}-'), built_wheel.name
    with zipfile.ZipFile(built_wheel) as wheel:
        metadata = wheel.read(f'timm_hbf-{timm_hbf.__version__}.dist-info/METADATA').decode()
    assert f'\nVersion: {timm_hbf.__version__}\n' in metadata


def write_train_run(folder: Path, model_name: str, checkpoint: str = 'last.pth.tar') -> Path:
    """A train.py output folder of ``model_name`` (untrained weights, 10 classes): the checkpoint, ``args.yaml`` and
    a one-epoch ``summary.csv``; returns the checkpoint."""
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = timm.create_model(model_name, pretrained=False, num_classes=10)
    path = folder / checkpoint
    torch.save({'epoch': 0, 'arch': model_name, 'state_dict': model.state_dict()}, path)
    (folder / 'args.yaml').write_text(yaml.safe_dump(dict(model=model_name, num_classes=10, model_kwargs={})))
    update_summary(0, dict(loss=2.3), dict(loss=2.3, top1=10., top5=50.), folder / 'summary.csv', write_header=True)
    return path


def quick_start() -> Tuple[str, List[Tuple[str, str, str]], List[str]]:
    """The README's quick start (the first Python block of its section); for each checkpoint of the reader's own
    (``NAME = timm.create_model(MODEL, ..., pretrained_cfg_overlay=dict(file=PATH))``) NAME, MODEL and PATH; the
    images it opens (``Image.open(PATH)``)."""
    readme = (ROOT / 'README.md').read_text()
    assert '\n## Quick start\n' in readme, 'README.md has no "## Quick start" section'
    section = readme.split('\n## Quick start\n', 1)[1].split('\n## ', 1)[0]
    blocks = re.findall(r'```python\n(.*?)```', section, re.S)
    assert blocks, "README.md's quick start has no Python block"
    code = blocks[0]
    own = []
    for match in re.finditer(r"pretrained_cfg_overlay=dict\(file='([^']+)'\)", code):
        built = re.findall(r"(\w+) = timm\.create_model\('([\w.]+)'", code[:match.start()])
        assert built, f'the quick start names no model built with {match.group(0)}'
        own.append((*built[-1], match.group(1)))
    return code, own, re.findall(r"Image\.open\('([^']+)'\)", code)


QUICK_START_CHECK = '''
import json, sys, torch
code = open('quick_start.py').read()
scope = {}
exec(compile(code, 'quick_start.py', 'exec'), scope)
own = {}
for name, path in zip(sys.argv[1::2], sys.argv[2::2]):
    built, saved = scope[name].state_dict(), torch.load(path, weights_only=True)['state_dict']
    own[name] = saved.keys() == built.keys() and all(torch.equal(v, built[k]) for k, v in saved.items())
print(json.dumps(dict(timm_hbf=sys.modules['timm_hbf'].__file__, own_weights=own)))
'''


def test_the_readmes_quick_start(wheel_env, cifar10_sample, tmp_path):
    """The code runs as it stands, offline, where a train.py checkpoint lies at each path it names and a CIFAR-10
    test image at each image path; each model it builds from such a checkpoint holds that checkpoint's weights."""
    code, own, images = quick_start()
    for _, model_name, path in own:
        write_train_run((tmp_path / path).parent, model_name, Path(path).name)
    for path in images:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(sorted((cifar10_sample / 'test' / 'cat').iterdir())[0], tmp_path / path)
    (tmp_path / 'quick_start.py').write_text(code)
    args = [arg for name, _, path in own for arg in (name, str(tmp_path / path))]
    proc = run_in(wheel_env, 'python', '-c', QUICK_START_CHECK, *args, cwd=tmp_path, timeout=600, **OFFLINE)
    assert proc.returncode == 0, f'{code}\n{proc.stdout}{proc.stderr}'
    result = json.loads(proc.stdout.splitlines()[-1])
    assert Path(result['timm_hbf']).is_relative_to(wheel_env)
    assert result['own_weights'] == {name: True for name, _, _ in own}


PRETRAINED_CHECK = '''
import json, sys, timm, torch
loaded, state_dicts = {}, {}
for name in sys.argv[2:]:
    model = timm.create_model(name, pretrained=True)
    cfg, state_dicts[name] = model.pretrained_cfg, model.state_dict()
    loaded[name] = dict(tag=cfg['tag'], file=cfg['file'], classes=len(cfg['label_names']),
                        dtypes=sorted({str(v.dtype) for v in state_dicts[name].values()}))
torch.save(state_dicts, sys.argv[1])
print(json.dumps(loaded))
'''


def test_pretrained_loads_every_default_tag_offline_from_the_installed_wheel(wheel_env, tmp_path):
    """Each model with weights loads its default tag from a file of the install, offline, into float32: the weights
    that the repository's package loads."""
    saved = tmp_path / 'state_dicts.pt'
    proc = run_in(wheel_env, 'python', '-c', PRETRAINED_CHECK, str(saved), *DEFAULT_WEIGHTS, cwd=tmp_path,
                  timeout=600, HF_HOME=str(tmp_path / 'hf'), **OFFLINE)
    assert proc.returncode == 0, proc.stderr
    loaded, state_dicts = json.loads(proc.stdout), torch.load(saved, weights_only=True)
    assert loaded.keys() == DEFAULT_WEIGHTS.keys()
    for name, result in loaded.items():
        assert result['tag'] == get_pretrained_cfg(name).tag, name
        assert Path(result['file']).name == Path(DEFAULT_WEIGHTS[name]).name, name
        assert Path(result['file']).is_relative_to(wheel_env), f'{name}: {result["file"]} is no file of the install'
        assert (result['classes'], result['dtypes']) == (10, ['torch.float32']), name
        expected = timm.create_model(name, pretrained=True).state_dict()
        assert state_dicts[name].keys() == expected.keys(), name
        for key, value in expected.items():
            assert torch.equal(state_dicts[name][key], value), f'{name}: {key}'


def test_push_dry_run_of_a_checkpoint(wheel_env, tmp_path):
    checkpoint = write_train_run(tmp_path / 'output' / 'train' / 'run', 'vit_hyperbf_tiny')
    folder = tmp_path / 'repo'
    proc = run_in(wheel_env, 'timm-hbf', 'push', str(checkpoint.parent), '--repo-id', 'someone/vit-hyperbf-tiny',
                  '--dtype', 'bfloat16', '--dry-run', str(folder), cwd=tmp_path, timeout=300, **OFFLINE)
    assert proc.returncode == 0, proc.stderr
    assert f'to {folder}; nothing was pushed' in proc.stdout
    assert {'config.json', 'model.safetensors', 'README.md'} <= {p.name for p in folder.iterdir()}
    assert json.loads((folder / 'config.json').read_text())['architecture'] == 'vit_hyperbf_tiny'
    pushed = load_file(folder / 'model.safetensors')
    trained = torch.load(checkpoint, weights_only=True)['state_dict']
    assert pushed.keys() == trained.keys()
    for name, weight in pushed.items():  # bf16 but the kernel widths
        expected = trained[name] if name.endswith('log_gamma') else trained[name].bfloat16()
        assert torch.equal(weight, expected), name


EVALUATE = """
import json, sys, timm, torch
from timm.data import create_dataset, create_loader, resolve_data_config
root, names = sys.argv[1], sys.argv[2:]
results = []
for name in names:
    model = timm.create_model(name, pretrained=True).eval()
    config = resolve_data_config(model=model)
    loader = create_loader(create_dataset('', root=root, split='test'), batch_size=100, num_workers=1,
                           use_prefetcher=False, device=torch.device('cpu'),
                           **{k: config[k] for k in ('input_size', 'interpolation', 'mean', 'std', 'crop_pct')})
    correct = total = 0
    with torch.inference_mode():
        for images, labels in loader:
            correct += (model(images).argmax(-1) == labels).sum().item()
            total += len(labels)
    results.append(dict(model=name, top1=100 * correct / total))
print(json.dumps(results))
"""


@pytest.fixture(scope='session')
def timm_validate_py() -> Path:
    """timm's validate.py from the folder ``TIMM_HBF_TIMM_SCRIPTS`` names, or None where it is not set."""
    value = os.environ.get(SCRIPTS_VARIABLE)
    if not value:
        return None
    script = Path(value) / 'validate.py'
    if not script.is_file():
        pytest.fail(f'{SCRIPTS_VARIABLE}={value} holds no validate.py: name a clone of pytorch-image-models',
                    pytrace=False)
    return script


def test_timms_validate_py_on_the_committed_sample(timm_validate_py, wheel_env, cifar10_sample, tmp_path):
    """validate.py --pretrained of every model with weights on the sample's 200 test images, in one bulk run: each
    is far above chance."""
    if timm_validate_py is None:  # the functions validate.py evaluates with
        cmd = ['python', '-c', EVALUATE, str(cifar10_sample), *DEFAULT_WEIGHTS]
        proc = run_in(wheel_env, *cmd, cwd=tmp_path, timeout=600, HF_HOME=str(tmp_path / 'hf'), **OFFLINE)
        report = f'{proc.stdout[-3000:]}{proc.stderr[-5000:]}'
        assert proc.returncode == 0, report
        results = {r['model']: r for r in json.loads(proc.stdout.strip().splitlines()[-1])}
    else:
        shutil.copy(timm_validate_py, tmp_path / 'validate.py')  # alone: a clone's timm/ beside it would be imported
        (tmp_path / 'models.txt').write_text('\n'.join(DEFAULT_WEIGHTS) + '\n')
        cmd = ['python', 'validate.py', '--model', 'models.txt', '--pretrained', '--data-dir', str(cifar10_sample),
               '--split', 'test', '--device', 'cpu', '--batch-size', '100', '--workers', '1',
               '--results-file', 'results.json', '--results-format', 'json']
        proc = run_in(wheel_env, *cmd, cwd=tmp_path, timeout=600, HF_HOME=str(tmp_path / 'hf'), **OFFLINE)
        report = f'$ {" ".join(cmd)}\n{proc.stdout[-3000:]}{proc.stderr[-5000:]}'
        assert proc.returncode == 0, report
        results = {r['model']: r for r in json.loads((tmp_path / 'results.json').read_text())}
    assert results.keys() == DEFAULT_WEIGHTS.keys(), report  # a model that fails is left out of the results
    low = {name: r['top1'] for name, r in results.items() if r['top1'] < MIN_SAMPLE_TOP1}
    assert not low, f'top-1 on the 200 test images below {MIN_SAMPLE_TOP1} %: {low}\n{report}'
