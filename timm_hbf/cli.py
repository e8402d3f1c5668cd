"""The ``timm-hbf`` command: ``timm-hbf push CHECKPOINT --repo-id ORG/NAME`` pushes a checkpoint of timm's train.py to
the Hugging Face Hub."""
import argparse
import ast
import sys
from typing import List, Optional

import torch

from .hub import HubError, push_to_hub, read_train_output, write_repo_folder
from .hub.push import check_repo_id

__all__ = ['ParseKwargs', 'main']


class ParseKwargs(argparse.Action):
    """``--model-kwargs`` as timm's scripts read it: ``KEY=VALUE`` items split at the first ``=``, each value a Python
    literal or else a string (as timm 1.0.31 reads them, also under older timm), with a usage error for an item that
    is not ``KEY=VALUE``. Use: ``parser.add_argument('--model-kwargs', nargs='*', action=ParseKwargs)``."""

    def __call__(self, parser, namespace, values, option_string=None):
        kwargs = {}
        for item in filter(None, values):
            key, equals, value = item.partition('=')
            if not (key and equals):
                raise argparse.ArgumentError(self, f'takes KEY=VALUE items, got {item!r}')
            try:
                kwargs[key] = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                kwargs[key] = value
        setattr(namespace, self.dest, kwargs)


def main(argv: Optional[List[str]] = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    parser = argparse.ArgumentParser(prog='timm-hbf', description='Tools for the timm-hbf models.',
                                     fromfile_prefix_chars='@')
    commands = parser.add_subparsers(title='commands', required=True, metavar='COMMAND')
    push = commands.add_parser(
        'push', help='push a train.py checkpoint to the Hugging Face Hub',
        description="Push a checkpoint of timm's train.py to a Hugging Face Hub model repo: config.json, "
                    'model.safetensors and a model card with the recipe, metrics and training curves of the run. Log '
                    'in first (hf auth login, or HF_TOKEN). Arguments can be read from a file, one per line: @FILE.')
    push.add_argument('checkpoint', metavar='CHECKPOINT',
                      help='train.py output folder (its model_best.pth.tar, else last.pth.tar) or checkpoint file')
    push.add_argument('--repo-id', required=True, type=_repo_id, metavar='ORG/NAME', help='the model repo')
    push.add_argument('--model', metavar='NAME', help='architecture, when neither checkpoint nor args.yaml names it')
    push.add_argument('--model-kwargs', nargs='*', action=ParseKwargs, metavar='KEY=VALUE',
                      help="model arguments it was trained with (train.py's), in place of args.yaml's")
    push.add_argument('--ema', action='store_true', help="push the EMA weights (train.py's --model-ema)")
    push.add_argument('--label-names', nargs='+', metavar='NAME', help='class names in classifier order')
    push.add_argument('--private', action='store_true', help='create the repo private')
    push.add_argument('--revision', metavar='BRANCH', help='commit to this branch, created if missing (default: main)')
    push.add_argument('--create-pr', action='store_true', help='open a pull request instead of committing')
    push.add_argument('--pytorch-bin', action='store_true',
                      help='also push pytorch_model.bin (pickled) for tools that cannot read safetensors')
    push.add_argument('--dtype', choices=('bfloat16', 'float16', 'float32'),
                      help='write the weights in this dtype, kernel widths (log_gamma) kept float32 (default: as in '
                           'the checkpoint; bfloat16 halves the files, and timm loads them into float32 models)')
    push.add_argument('--dry-run', metavar='FOLDER',
                      help='write the files that would be pushed into the new folder FOLDER and push nothing')
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    try:
        train = read_train_output(args.checkpoint, model_name=args.model, ema=args.ema, model_kwargs=args.model_kwargs)
        if args.dry_run:
            folder = write_repo_folder(train, args.dry_run, args.repo_id, args.label_names, args.pytorch_bin, dtype)
            print(f'Wrote {", ".join(sorted(p.name for p in folder.iterdir()))} to {folder}; nothing was pushed.')
            return 0
        info = push_to_hub(train, args.repo_id, label_names=args.label_names, private=args.private,
                           revision=args.revision, create_pr=args.create_pr, pytorch_bin=args.pytorch_bin, dtype=dtype)
    except (HubError, OSError) as e:  # OSError: a file that cannot be read, with its path
        print(f'error: {e}', file=sys.stderr)
        return 1
    print(f'Pushed {train.checkpoint} to {info.pr_url or info.commit_url}')
    print(f"Load it with: timm.create_model('hf-hub:{info.repo_url.repo_id}@{info.oid}', pretrained=True)")
    return 0


def _repo_id(value: str) -> str:
    try:
        return check_repo_id(value)
    except HubError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


if __name__ == '__main__':
    sys.exit(main())
