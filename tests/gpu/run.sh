#!/usr/bin/env bash
# The GPU suite, in one command, on a machine with CUDA GPUs (CI has none):
#
#   bash tests/gpu/run.sh            # from the repository root
#   ZARRCKPT_GPU_SCENARIOS=tiers_gpu_state,mixed_state_saves bash tests/gpu/run.sh   # a subset
#
# Installs what the machine lacks: the wheels in .whl/ when there are some (a machine with no
# package index: fill .whl/ with ../shared/tools/device-wheels.sh first and carry it), else
# `pip install -e .`. Then runs every test marked `gpu` (tests/gpu/: values checked bit for bit
# against the state at the call, on 1, 2 and 4 GPUs as the machine has them; the CUDA cases
# of test_cuda.py, test_async.py and test_tiles.py) and appends one line to
# tests/gpu/RESULTS.md: date, commit (ZARRCKPT_COMMIT, else git's HEAD), device, torch
# version and pytest's counts. Copies the log and that line to $OUT when it is set.
# Exit status: pytest's.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/zarrckpt-site .whl/*.whl || exit 2
  export PYTHONPATH=/tmp/zarrckpt-site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  python3 -m pip install -q -e . pytest hypothesis || exit 2
fi
commit=${ZARRCKPT_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
log=$(mktemp)
python3 -m pytest -q -p no:cacheprovider -m gpu -rfEP tests/gpu tests/test_cuda.py tests/test_async.py \
  tests/test_tiles.py "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
counts=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error)' "$log" | tail -1 | sed -E 's/^=+ //; s/ =+$//')
device=$(python3 -c 'import torch; n=torch.cuda.device_count(); print(f"{n}x {torch.cuda.get_device_name(0)}" if n else "no GPU")')
torchv=$(python3 -c 'import torch; print(torch.__version__)')
line="| $(date -u +%Y-%m-%dT%H:%MZ) | $commit | $device | torch $torchv | ${counts:-no result (rc $rc)} |"
echo "$line" >> tests/gpu/RESULTS.md
echo "GPU SUITE RESULT: $line"
if [ -n "${OUT:-}" ]; then cp "$log" "$OUT/gpu-suite.log"; cp tests/gpu/RESULTS.md "$OUT/RESULTS.md"; fi
exit "$rc"
