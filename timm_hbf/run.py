"""Run one of timm's scripts with timm_hbf's models registered.

    python -m timm_hbf.run pytorch-image-models/validate.py --model vit_hyperbf_tiny --data-dir cifar10 ...
    torchrun --nproc_per_node 2 -m timm_hbf.run pytorch-image-models/train.py --model vit_hyperbf_tiny ...

SCRIPT is any script of timm's git repository (train.py, validate.py, inference.py, benchmark.py, ...; the timm
package does not install them): it runs as ``python SCRIPT ARGS...`` would (as ``__main__``, with its folder first on
``sys.path``), after ``import timm_hbf``.
"""
import runpy
import sys
from pathlib import Path
from typing import Optional, Sequence

USAGE = "usage: python -m timm_hbf.run SCRIPT [ARGS...]   (SCRIPT: timm's train.py, validate.py, ...)"


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Run ``argv[0]`` as ``__main__`` with ``argv`` as its ``sys.argv``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ('-h', '--help'):
        print(f'{USAGE}\n\n{__doc__}' if argv else USAGE, file=sys.stdout if argv else sys.stderr)
        raise SystemExit(0 if argv else 2)
    script = Path(argv[0])
    if argv[0].startswith(('--local-rank', '--local_rank')):
        raise SystemExit(f'timm_hbf.run: got {argv[0]} where the script goes, as torch.distributed.launch passes it. '
                         'Launch with torchrun, as timm does: torchrun --nproc_per_node N -m timm_hbf.run '
                         'pytorch-image-models/train.py ...')
    if script.suffix != '.py' or script.is_dir():
        raise SystemExit(f'timm_hbf.run: SCRIPT must be a Python file such as train.py, got {argv[0]!r}' + (
            f', a folder: name the script in it, e.g. python -m timm_hbf.run {script / "train.py"} ...' if
            script.is_dir() else '. The script comes first, its arguments after it: python -m timm_hbf.run SCRIPT '
                                 '[ARGS...]'))
    if not script.is_file():
        raise SystemExit(f"timm_hbf.run: no script at '{script}'. timm's scripts are not installed with timm: get "
                         'them with `git clone https://github.com/huggingface/pytorch-image-models` and give the '
                         'path, e.g. python -m timm_hbf.run pytorch-image-models/train.py ...')

    import timm_hbf  # noqa: F401  (registers the models)

    sys.argv = [str(script), *argv[1:]]
    sys.path.insert(0, str(script.resolve().parent))
    runpy.run_path(str(script), run_name='__main__')


if __name__ == '__main__':
    main()
