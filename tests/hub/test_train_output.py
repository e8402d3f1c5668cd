"""Reading train.py's output: the checkpoint a folder stands for, EMA weights, the arguments and metrics, and
weights-only unpickling."""
import shutil

import pytest
import torch
import yaml

from timm_hbf.hub import HubError, read_summary, read_train_output

from .conftest import HYPERBF, assert_same_tensors, load_checkpoint


def test_a_folder_stands_for_its_best_checkpoint_with_args_and_summary(train_run):
    train = read_train_output(train_run)
    best = load_checkpoint(train_run / 'model_best.pth.tar')
    assert (train.checkpoint, train.arch, train.epoch, train.ema) == (train_run / 'model_best.pth.tar', HYPERBF, 0,
                                                                      False)
    assert train.model_kwargs == {'depth': 2, 'num_classes': 10, 'in_chans': 3}
    assert_same_tensors(train.state_dict, best['state_dict'])
    assert train.args == yaml.safe_load((train_run / 'args.yaml').read_text())
    assert [row['epoch'] for row in train.summary] == [0, 1, 2]
    assert {'train_loss', 'eval_loss', 'eval_top1', 'eval_top5'} <= set(train.summary[0])
    model = train.create_model()
    assert not model.training and len(model.blocks) == 2
    assert_same_tensors(model.state_dict(), train.state_dict)


def test_without_best_checkpoint_the_last_one_and_its_ema_weights(train_run, tmp_path):
    run = shutil.copytree(train_run, tmp_path / 'run')
    (run / 'model_best.pth.tar').unlink()
    train = read_train_output(run, ema=True)
    assert train.checkpoint == run / 'last.pth.tar' and train.ema and train.epoch == 2
    assert_same_tensors(train.state_dict, load_checkpoint(run / 'last.pth.tar')['state_dict_ema'])


def test_without_args_yaml_the_arguments_stored_in_the_checkpoint(train_run, tmp_path):
    shutil.copy(train_run / 'last.pth.tar', tmp_path)
    train = read_train_output(tmp_path / 'last.pth.tar')
    assert train.arch == HYPERBF and train.args['model_kwargs'] == {'depth': 2} and train.summary == []


def test_a_resumed_run_keeps_the_rows_written_after_the_resume(tmp_path):
    """Resumed at epoch 1 from an older checkpoint: the first run's epochs 1-3 are dropped, not only those written
    again."""
    header = 'epoch,train_loss,eval_top1'
    (tmp_path / 'summary.csv').write_text('\n'.join([header, '0,1,10', '1,1,20', '2,1,30', '3,1,90', header, '1,2,21',
                                                     '2,2,31']))
    rows = read_summary(tmp_path / 'summary.csv')
    assert [tuple(row.values()) for row in rows] == [(0, 1., 10.), (1, 2., 21.), (2, 2., 31.)]


class Payload:
    def __reduce__(self):
        return exec, ("open(__import__('os').environ['PAYLOAD_MARK'], 'w').close()",)


def test_pickled_code_never_runs(tmp_path, monkeypatch):
    monkeypatch.setenv('PAYLOAD_MARK', str(tmp_path / 'ran'))
    torch.save({'state_dict': {'w': torch.zeros(1)}, 'extra': Payload()}, tmp_path / 'evil.pth.tar')
    with pytest.raises(HubError, match='evil.pth.tar'):
        read_train_output(tmp_path / 'evil.pth.tar')
    assert not (tmp_path / 'ran').exists()
    torch.load(tmp_path / 'evil.pth.tar', weights_only=False)  # the payload does run when unpickled unrestricted
    assert (tmp_path / 'ran').exists()
