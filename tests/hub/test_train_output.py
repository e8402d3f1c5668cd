"""Reading train.py's output: the checkpoint a folder stands for, EMA weights, the recipe, the metrics, and only
weights-only unpickling (timm's reading)."""
import pickle
import shutil

import pytest
import safetensors.torch
import torch
import yaml

from timm_hbf.hub import HubError, read_summary, read_train_output

from .conftest import assert_same_tensors, load_checkpoint


def test_folder_stands_for_its_best_checkpoint(train_run):
    train = read_train_output(train_run)
    best = load_checkpoint(train_run / 'model_best.pth.tar')
    assert train.checkpoint == train_run / 'model_best.pth.tar'
    assert train.arch == 'vit_hyperbf_tiny'
    assert train.model_kwargs == {'depth': 2, 'num_classes': 10, 'in_chans': 3}
    assert_same_tensors(train.state_dict, best['state_dict'])
    assert not train.ema and train.epoch == best['epoch']
    assert train.args == yaml.safe_load((train_run / 'args.yaml').read_text())
    assert [row['epoch'] for row in train.summary] == [0, 1, 2, 3]
    assert set(train.summary[0]) == {'epoch', 'train_loss', 'eval_loss', 'eval_top1', 'eval_top5', 'lr'}
    assert max(train.summary, key=lambda row: row['eval_top1'])['eval_top1'] == best['metric']


def test_a_resumed_runs_summary_has_one_row_per_epoch_the_last_of_each(train_run, tmp_path):
    run = shutil.copytree(train_run, tmp_path / 'run')
    lines = (run / 'summary.csv').read_text().splitlines()
    header, rows = lines[0], lines[1:]
    # killed after epoch 2's row and before its checkpoint: train.py resumed at epoch 2 writes its header again
    (run / 'summary.csv').write_text('\n'.join([header, *rows[:3], header, rows[2].replace(',', ',1', 1),
                                                *rows[3:]]) + '\n')
    summary = read_train_output(run).summary
    assert [row['epoch'] for row in summary] == [0, 1, 2, 3]
    assert summary[2]['train_loss'] == float('1' + rows[2].split(',')[1])  # the row written after the resume


def test_a_run_resumed_from_an_older_checkpoint_drops_the_abandoned_epochs(tmp_path):
    """Resumed at epoch 1 from an older checkpoint and stopped after epoch 2: the first run's epochs 1-3 are gone,
    not only those the resumed run wrote again."""
    path = tmp_path / 'summary.csv'
    header = 'epoch,train_loss,eval_top1'
    path.write_text('\n'.join([header, '0,1,10', '1,1,20', '2,1,30', '3,1,90', header, '1,2,21', '2,2,31']) + '\n')
    assert [tuple(row.values()) for row in read_summary(path)] == [(0, 1., 10.), (1, 2., 21.), (2, 2., 31.)]


def test_folder_without_best_checkpoint_stands_for_the_last(train_run, tmp_path):
    run = shutil.copytree(train_run, tmp_path / 'run')
    (run / 'model_best.pth.tar').unlink()
    assert read_train_output(run).checkpoint == run / 'last.pth.tar'


def test_ema_weights(train_run):
    train = read_train_output(train_run / 'last.pth.tar', ema=True)
    assert train.ema and train.epoch == 3
    assert_same_tensors(train.state_dict, load_checkpoint(train_run / 'last.pth.tar')['state_dict_ema'])


def test_create_model_gives_the_checkpoint_weights_in_eval_mode(train_run):
    train = read_train_output(train_run)
    model = train.create_model()
    assert not model.training and len(model.blocks) == 2
    assert_same_tensors(model.state_dict(), train.state_dict)


def test_train_py_gp_rebuilds_the_model_with_that_global_pooling(avg_pool_train_run):
    """train.py's ``--gp avg`` is the model argument ``global_pool='avg'``, the model the weights (with ``fc_norm``,
    without ``norm``) fit."""
    train = read_train_output(avg_pool_train_run)
    assert train.args['gp'] == 'avg'
    assert train.model_kwargs == {'depth': 2, 'global_pool': 'avg', 'num_classes': 10, 'in_chans': 3}
    assert 'fc_norm.weight' in train.state_dict and 'norm.weight' not in train.state_dict
    model = train.create_model()
    assert model.global_pool == 'avg' and not model.training
    assert_same_tensors(model.state_dict(), train.state_dict)


def test_args_come_from_the_checkpoint_without_args_yaml(train_run, tmp_path):
    shutil.copy(train_run / 'last.pth.tar', tmp_path)
    train = read_train_output(tmp_path / 'last.pth.tar')
    assert train.args['model_kwargs'] == {'depth': 2} and train.arch == 'vit_hyperbf_tiny'
    assert train.summary == []


def test_state_dict_needs_the_model_name(train_run, tmp_path):
    state_dict = load_checkpoint(train_run / 'last.pth.tar')['state_dict']
    safetensors.torch.save_file(state_dict, tmp_path / 'weights.safetensors')
    with pytest.raises(HubError, match='does not name its architecture: pass --model'):
        read_train_output(tmp_path / 'weights.safetensors')
    train = read_train_output(tmp_path / 'weights.safetensors', model_name='vit_hyperbf_tiny')
    assert train.epoch is None and train.model_kwargs == {'num_classes': 10, 'in_chans': 3}
    with pytest.raises(HubError, match=r'does not fit vit_hyperbf_tiny .*: 130 missing \(blocks\.2\.norm1\.weight, '):
        train.create_model()  # the weights have 2 blocks; without args.yaml, the model has 12


@pytest.mark.parametrize('kwargs, message', [
    (dict(model_name='vit_hyperbf_small'),
     r'does not fit vit_hyperbf_small .*: 33 of another shape \(cls_token \(1, 1, 192\) for \(1, 1, 384\), '),
    (dict(model_name='not_a_model'), "names 'not_a_model', which timm does not know"),
])
def test_wrong_architecture_is_named(train_run, kwargs, message):
    with pytest.raises(HubError, match=message):
        read_train_output(train_run, **kwargs).create_model()


def test_weights_that_do_not_fit_say_where_the_model_arguments_come_from(train_run, tmp_path):
    """Without args.yaml, the model arguments are those stored in the checkpoint: --model-kwargs replaces them."""
    shutil.copy(train_run / 'last.pth.tar', tmp_path)
    with pytest.raises(HubError) as e:
        read_train_output(tmp_path / 'last.pth.tar', model_name='vit_hyperbf_small').create_model()
    assert (f"built with {{'depth': 2, 'num_classes': 10, 'in_chans': 3}} (the model arguments of {tmp_path}/"
            'last.pth.tar): 33 of another shape') in str(e.value)
    assert str(e.value).endswith(". Give the model arguments it was trained with (train.py's --model-kwargs, e.g. "
                                 'depth=2) with --model-kwargs; check --model too.')


def test_plain_state_dict_has_no_ema(train_run, tmp_path):
    torch.save(load_checkpoint(train_run / 'last.pth.tar')['state_dict'], tmp_path / 'weights.pth')
    with pytest.raises(HubError, match='has no EMA weights: train.py saves them when it trains with --model-ema'):
        read_train_output(tmp_path / 'weights.pth', model_name='vit_hyperbf_tiny', ema=True)


class Payload:
    def __reduce__(self):
        return exec, ("open(__import__('os').environ['PAYLOAD_MARK'], 'w').close()",)


def test_pickled_code_never_runs(tmp_path, monkeypatch):
    mark = tmp_path / 'payload-ran'
    monkeypatch.setenv('PAYLOAD_MARK', str(mark))
    torch.save({'state_dict': {'w': torch.zeros(1)}, 'extra': Payload()}, tmp_path / 'evil.pth.tar')
    with pytest.raises(HubError, match='evil.pth.tar holds Python objects besides tensors'):
        read_train_output(tmp_path / 'evil.pth.tar')
    assert not mark.exists()
    pickle.loads(pickle.dumps(Payload()))  # the payload does run when unpickled unrestricted
    assert mark.exists()


@pytest.mark.parametrize('name, message', [
    ('missing.pth.tar', 'missing.pth.tar does not exist. Name the weights file.'),
    ('empty-folder', 'empty-folder has no model_best.pth.tar or last.pth.tar: name the checkpoint to push.'),
    ('notes.pth', 'notes.pth holds no weights: it is neither a checkpoint of train.py nor a state dict'),
])
def test_nothing_to_push(tmp_path, name, message):
    (tmp_path / 'empty-folder').mkdir()
    torch.save({'notes': 'hello'}, tmp_path / 'notes.pth')
    with pytest.raises(HubError, match=message):
        read_train_output(tmp_path / name)
