"""The ``timm-hbf`` command: ``timm-hbf push CHECKPOINT --repo-id ORG/NAME`` pushes a checkpoint of timm's train.py to
the Hugging Face Hub."""
import argparse
import sys
from typing import List, Optional

import torch
from timm.utils import ParseKwargs

from .hub import HubError, push_to_hub, read_train_output, write_repo_folder
from .hub.push import check_repo_id

__all__ = ['main']


def main(argv: Optional[List[str]] = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    parser = argparse.ArgumentParser(prog='timm-hbf', fromfile_prefix_chars='@')
    commands = parser.add_subparsers(title='commands', required=True, metavar='COMMAND')
    push = commands.add_parser('push', help='push a train.py checkpoint to the Hugging Face Hub', description=(
        "Push a checkpoint of timm's train.py to a Hub model repo: config.json, model.safetensors and a model card. "
        'Log in first (hf auth login, or HF_TOKEN). @FILE reads arguments from FILE, one per line.'))
    push.add_argument('checkpoint', metavar='CHECKPOINT',
                      help='train.py output folder (its model_best.pth.tar, else last.pth.tar) or checkpoint file')
    push.add_argument('--repo-id', required=True, metavar='ORG/NAME', help='the model repo')
    push.add_argument('--model', metavar='NAME', help='architecture, when neither checkpoint nor args.yaml names it')
    push.add_argument('--model-kwargs', nargs='*', action=ParseKwargs, metavar='KEY=VALUE',
                      help="model arguments it was trained with (train.py's), in place of args.yaml's")
    push.add_argument('--ema', action='store_true', help="push the EMA weights (train.py's --model-ema)")
    push.add_argument('--label-names', nargs='+', metavar='NAME', help='class names in classifier order')
    push.add_argument('--private', action='store_true', help='create the repo private')
    push.add_argument('--revision', metavar='BRANCH', help='commit to this branch, created if missing (default: main)')
    push.add_argument('--create-pr', action='store_true', help='open a pull request instead of committing')
    push.add_argument('--pytorch-bin', action='store_true', help='also push pytorch_model.bin (pickled)')
    push.add_argument('--dtype', choices=('bfloat16', 'float16', 'float32'),
                      help='dtype of the weights file, kernel widths (log_gamma) kept float32 (default: as trained)')
    push.add_argument('--dry-run', metavar='FOLDER', help='write the files into the new FOLDER and push nothing')
    try:
        args = parser.parse_args(argv)
    except ValueError as e:  # timm's ParseKwargs, of an item without '='
        parser.error(f'--model-kwargs takes KEY=VALUE items ({e})')
    try:
        check_repo_id(args.repo_id)  # before any file is read
        train = read_train_output(args.checkpoint, model_name=args.model, ema=args.ema, model_kwargs=args.model_kwargs)
        dtype = getattr(torch, args.dtype) if args.dtype else None
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


if __name__ == '__main__':
    sys.exit(main())
