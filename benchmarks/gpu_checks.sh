#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one command, each writing its results under --out with the device, versions,
# command and date:
#   speed  benchmarks/throughput.py, bf16, batch 1024, eager and compiled, training and inference, peak memory: every
#          tiny model beside timm's ViT-Ti/4 at 32 x 32 (speed.json, speed.md), then torch.profiler's table of
#          --model's training step beside the ViT's (profile.log); first, alone on the GPU, as its ratios need;
#   tests  the CUDA tests (tests/cuda: every family on CUDA against the CPU in float32 and bf16, and compiled whole,
#          by region and past a graph break against eager) in two pytest processes (tests_*.log, tests_*.xml);
#   train  the strong CIFAR-10 recipe (timm_hbf/recipes/cifar10/strong.yaml) through benchmarks/accuracy.py on
#          timm's ViT-Ti/4 and --model side by side on the GPU, compiled, batch 512 (lr 2e-3 by the recipe's square
#          root rule), --epochs with a tenth of them warmup, the checkpoint chosen on 500 held-out training images a
#          class and tested once (cifar10_strong/); beside the tests.
# checks.json lists every stage's command, exit status and seconds; environment.json the machine and versions.
#
#   bash benchmarks/gpu_checks.sh --scripts pytorch-image-models --data cifar10 --out gpu_results \
#       [--stages "speed tests train"] [--epochs 100] [--model vit_attnres_tiny] [--workers 12] [--device cpu]
#
# --scripts: a checkout of timm's repository (train.py and validate.py); --data: CIFAR-10 as train/ and test/ with one
# folder per class. Run again with the same --out, the train stage resumes its runs (accuracy.py reads finished ones
# back). --device cpu rehearses every stage on the CPU at tiny sizes (one epoch of depth-2 models on 10 held-out
# images a class, one round of batch 8, the CUDA tests on the CPU) so that a GPU's time is not spent on a typo.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

command="bash benchmarks/gpu_checks.sh $*"
scripts='' data='' out='' stages='speed tests train' epochs=100 model=vit_attnres_tiny workers=12 device=cuda
usage() {
    echo 'usage: bash benchmarks/gpu_checks.sh --scripts DIR --data DIR --out DIR [--stages "speed tests train"]' \
         '[--epochs N] [--model NAME] [--workers N] [--device cuda|cpu]' >&2
    exit 2
}
while [ $# -gt 0 ]; do
    case "$1" in --scripts|--data|--out|--stages|--epochs|--model|--workers|--device) ;;
        *) echo "error: unknown argument $1" >&2; usage ;;
    esac
    [ $# -ge 2 ] || { echo "error: $1 needs a value" >&2; usage; }
    name="${1#--}"
    printf -v "$name" '%s' "$2"
    shift 2
done
[ -n "$out" ] || { echo 'error: give --out, the folder the results go to' >&2; usage; }
has() { case " $stages " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
if has train; then
    [ -f "$scripts/train.py" ] || { echo "error: --scripts '$scripts' has no train.py: give a checkout of timm's" \
        'repository (git clone https://github.com/huggingface/pytorch-image-models)' >&2; exit 2; }
    [ -d "$data/train" ] && [ -d "$data/test" ] || { echo "error: --data '$data' needs train/ and test/ folders," \
        'one folder per class inside each' >&2; exit 2; }
fi
for stage in $stages; do
    case "$stage" in speed|tests|train) ;; *) echo "error: unknown stage '$stage' (speed, tests, train)" >&2; exit 2 ;;
    esac
done
for number in "$epochs" "$workers"; do
    case "$number" in ''|*[!0-9]*) echo "error: --epochs and --workers take whole numbers, not '$number'" >&2; exit 2 ;;
    esac
done
case "$device" in cuda|cpu) ;; *) echo "error: --device '$device': cuda, or cpu to rehearse on the CPU" >&2; exit 2 ;; esac
mkdir -p "$out" && out="$(cd "$out" && pwd)"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_FX_GRAPH_CACHE=1 TORCHINDUCTOR_AUTOGRAD_CACHE=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the checkout's timm_hbf, installed or not
python="${PYTHON:-python3}"

if [ "$device" = cpu ]; then  # the rehearsal's sizes
    speed_args=(--batch-size 8 --rounds 1 --steps 1 --warmup 1 --model-kwargs depth=2)
    train_args=(--val-per-class 10 -- --device cpu --epochs 1 --batch-size 32 --workers 1
                --model-kwargs img_size=32 patch_size=4 depth=2)
    export TIMM_HBF_TEST_DEVICE=cpu
else
    speed_args=(--device cuda --amp --batch-size 1024 --rounds 5 --steps 5 --warmup 2)
    train_args=(--jobs 2 -- --epochs "$epochs" --warmup-epochs $(((epochs + 9) / 10)) --batch-size 512
                --torchcompile --workers $((workers / 2)) --pin-mem)
fi

"$python" - "$out/environment.json" "$command" <<'EOF'
import json, platform, subprocess, sys
from datetime import datetime, timezone
import timm, torch, timm_hbf
commit = subprocess.run(['git', 'rev-parse', 'HEAD'], capture_output=True, text=True).stdout.strip()
json.dump(dict(
    date=datetime.now(timezone.utc).isoformat(timespec='seconds'), command=sys.argv[2],
    device=torch.cuda.get_device_name() if torch.cuda.is_available() else f'CPU ({platform.machine()})',
    versions=dict(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
                  timm=timm.__version__, timm_hbf=timm_hbf.__version__, commit=commit or None),
), open(sys.argv[1], 'w'), indent=2)
EOF
[ $? -eq 0 ] || { echo 'error: python cannot import timm, torch and timm_hbf' >&2; exit 1; }

: > "$out/checks.tsv"
# stage NAME COMMAND...: run it, its output in NAME.log, and record its exit status and seconds
stage() {
    local name="$1" start=$SECONDS rc=0 quoted
    shift
    printf -v quoted '%q ' "$@"
    echo "--- $name: $quoted"
    "$@" > "$out/$name.log" 2>&1 || rc=$?
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" "${quoted% }" >> "$out/checks.tsv"
    echo "--- $name: exit status $rc in $((SECONDS - start)) s"
}
if has speed; then
    stage speed "$python" benchmarks/throughput.py --compiled "${speed_args[@]}" --json "$out/speed.json"
    stage profile "$python" benchmarks/throughput.py --compiled "${speed_args[@]}" --rounds 1 --models "$model" \
        --modes train --profile
fi
if has train; then
    stage train "$python" benchmarks/accuracy.py --scripts "$scripts" --data "$data" --out "$out/cifar10_strong" \
        --recipe timm_hbf/recipes/cifar10/strong.yaml --models vit_tiny_patch16_224 "$model" "${train_args[@]}" &
fi
if has tests; then
    stage tests_compiled "$python" -m pytest tests/cuda -q -rfEs -p no:cacheprovider -k compile \
        --junitxml "$out/tests_compiled.xml" &
    stage tests_other "$python" -m pytest tests/cuda -q -rfEs -p no:cacheprovider -k 'not compile' \
        --junitxml "$out/tests_other.xml" &
fi
wait

"$python" - "$out" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = [line.split('\t') for line in (out / 'checks.tsv').read_text().splitlines()]
checks = {name: dict(exit_status=int(rc), seconds=int(s), command=cmd) for name, rc, s, cmd in rows}
(out / 'checks.json').write_text(json.dumps(checks, indent=2) + '\n')
(out / 'checks.tsv').unlink()
print(json.dumps(checks, indent=2))
sys.exit(any(c['exit_status'] for c in checks.values()))
EOF
