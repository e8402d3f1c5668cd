"""The wheel as a user installs it: its weights and size, and installed alone (``wheel_env``, tests/conftest.py) in a
new environment, where the README's quick start, every default tag's weights offline (the weights the repository's
package loads) and ``timm-hbf push --dry-run`` run."""
import json
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
from tests.helpers import ROOT, build_distribution, run_in

pytestmark = pytest.mark.slow  # builds the wheel and installs it

FAMILIES = ['vit_hyperbf', 'vit_qimia', 'vit_attnres']  # timm's module names of our models
OFFLINE = dict(HF_HUB_OFFLINE='1')


def default_weights() -> Dict[str, str]:
    """Every model of ours whose default tag has weights of our own (not timm's on the Hub), and that tag's file."""
    cfgs = {name: get_pretrained_cfg(name) for name in timm.list_models(module=FAMILIES)}
    return {name: cfg.file for name, cfg in cfgs.items()
            if (cfg.file or cfg.url or cfg.hf_hub_id) and not (cfg.hf_hub_id or '').startswith('timm/')}


DEFAULT_WEIGHTS = default_weights()


def test_the_wheel_is_of_the_packages_version_and_ships_each_default_tags_weights_and_no_others(built_wheel):
    assert built_wheel.name.startswith(f'timm_hbf-{timm_hbf.__version__}-'), built_wheel.name
    with zipfile.ZipFile(built_wheel) as wheel:
        shipped = {PurePosixPath(n).name: wheel.getinfo(n).file_size for n in wheel.namelist()
                   if PurePosixPath(n).parent == PurePosixPath('timm_hbf/weights')}
        metadata = wheel.read(f'timm_hbf-{timm_hbf.__version__}.dist-info/METADATA').decode()
    assert f'\nVersion: {timm_hbf.__version__}\n' in metadata
    # superseded tags leave the package; a file of a few bytes would be an LFS pointer
    assert set(shipped) == {Path(file).name for file in DEFAULT_WEIGHTS.values()}
    assert all(size > 2 ** 20 for size in shipped.values()), shipped


@pytest.mark.parametrize('target, limit', [('wheel', 60e6), ('sdist', 100e6)])  # the package index takes 100 MB a file
def test_the_distributions_stay_under_their_size_limit(target, limit, request, tmp_path):
    built = request.getfixturevalue('built_wheel') if target == 'wheel' else build_distribution(target, tmp_path)
    assert built.stat().st_size < limit, f'{built.name}: {built.stat().st_size / 1e6:.1f} MB'


def write_train_run(folder: Path, model_name: str, checkpoint: str = 'last.pth.tar') -> Path:
    """A train.py output folder of ``model_name`` (untrained, 10 classes, one epoch); returns the checkpoint."""
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
    """Offline, from a file of the install, into float32: the weights that the repository's package loads."""
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
    trained = torch.load(checkpoint, weights_only=True)['state_dict']  # its weights as pushed: tests/hub/test_push.py
    assert load_file(folder / 'model.safetensors').keys() == trained.keys()
