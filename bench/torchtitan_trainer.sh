#!/usr/bin/env bash
# Issue 17: torchtitan 0.3.0's trainer (llama3 debug model, FSDP2 over NCCL) with zarrckpt's
# checkpointer backend and with torchtitan's DCP backend, kill and resume, on a GPU host
# without a package index. Writes $OUT/torchtitan_trainer.json, $OUT/run.log, $OUT/logs.tgz.
#
#   bash bench/torchtitan_trainer.sh wheels     # here, once: the wheels the GPU host lacks -> .whl-tt/
#   bash bench/torchtitan_trainer.sh [ARGS]     # on the GPU host (ARGS go to torchtitan_trainer.py run)
#
# The device tool: carry [".whl-tt"], command `bash bench/torchtitan_trainer.sh`.
set -uo pipefail
cd "$(dirname "$0")/.."
W=.whl-tt

if [ "${1:-}" = wheels ]; then
  grep -qx "/$W/" .git/info/exclude 2>/dev/null || echo "/$W/" >> .git/info/exclude
  mkdir -p $W
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    --platform manylinux_2_5_x86_64 -d $W \
    tensorstore==0.1.86 zarr==3.1.6 numcodecs==0.16.6 donfig==0.8.1.post1 google-crc32c==1.9.0 \
    crc32c==2.9.post0 torchtitan==0.3.0 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 \
    datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18 xxhash==4.1.0 torchdata==0.11.0 \
    spmd_types==0.2.3 pandas==3.1.1 python-dateutil==4.0.0 pytz==2026.6 tzdata==2026.6
  du -sh $W
  exit
fi

OUT=${OUT:-/tmp/torchtitan-trainer-out}
mkdir -p "$OUT"
# pandas and its needs only where the host has no pandas (datasets imports it)
skip='^$'
python3 -c 'import pandas' 2>/dev/null && skip='/(pandas|python_dateutil|pytz|tzdata)-'
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  $(ls $W/*.whl | grep -Ev "$skip") || exit 1
export PYTHONPATH=/tmp/site:$PWD
# NVLink multicast stays off (the GPU hosts require it)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi -L
python3 - <<'EOF' || exit 1
import sys
sys.path.insert(0, "bench")
import torchtitan_launch
print("added where missing:", torchtitan_launch.apply())
import torch, torchtitan.train, torchtitan.models.llama3.config_registry, zarrckpt.interop.torchtitan
print("torch", torch.__version__, "gpus", torch.cuda.device_count(), "torchtitan ok, zarrckpt backend ok")
EOF
WORK=/tmp/zarrckpt-torchtitan
python3 bench/torchtitan_trainer.py run --out "$OUT/torchtitan_trainer.json" --workdir $WORK "$@" 2>&1 | tee "$OUT/run.log"
rc=${PIPESTATUS[0]}
(cd $WORK && tar czf "$OUT/logs.tgz" $(find . -name '*.log'))
exit $rc
