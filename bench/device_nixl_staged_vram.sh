#!/usr/bin/env bash
# The staged NIXL path in GPU memory on a GPU machine (one H200; the wheels in .whl-min/,
# docs/benchmarks/device-runs.md; from the repository root):
#   bash bench/device_nixl_staged_vram.sh          # the GPU tests, then every cell: block 16/64/128 x TP same/2:1/1:2/4:1
#   BENCH_ONLY=1 CHUNK2_KIB=16384 bash bench/device_nixl_staged_vram.sh   # no tests; block 16 again at 16 MiB chunks
#   DRY=1 bash bench/device_nixl_staged_vram.sh    # the staged GPU tests and one cell (block 16, same), chunk 8 and 32 MiB
# bench/nixl_staged.py --mem VRAM: KV and staging buffers on cuda:0 in both processes, scattered 8k-token requests,
# direct vs staged vs the one-descriptor anchor side by side (UCX_TLS left to UCX: two processes on one GPU get no
# cuda_ipc lane, so UCX emulates every READ over tcp/lo; the ratio to the anchor on the same transport is the
# measure). JSONs and logs land in $OUT (default bench/out).
set -u
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-min/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 UCX_NET_DEVICES=lo VLLM_HOST_IP=127.0.0.1
unset UCX_TLS
T0=$(date +%s)
nproc
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
bench() {  # chunk KiB, then nixl_staged.py's own arguments
  local chunk=$1
  shift
  echo "== nixl_staged --mem VRAM chunk ${chunk} KiB $*, t=$(($(date +%s) - T0)) s"
  timeout "${BENCH_TIMEOUT:-380}" python3 bench/nixl_staged.py --mem VRAM --tokens 8192 --chunk-kib "$chunk" \
    --staging-mib 256 --out "$OUT" "$@" 2>&1 | grep -v "NIXL INFO" | tee -a "$OUT/staged-vram.log"
}
if [ -n "${DRY:-}" ]; then
  echo "== GPU test (staged, one pair), t=$(($(date +%s) - T0)) s"
  timeout 150 python3 -m pytest -q -rs -x tests/gpu/test_gpu_runtime.py -k staged_nixl -p no:cacheprovider 2>&1 \
    | tail -40 | tee "$OUT/gpu-tests-dry.log"
  BENCH_TIMEOUT=120 bench 8192 --block-sizes 16 --ratios same --reps 1 --budget-s 60
  BENCH_TIMEOUT=120 bench 32768 --block-sizes 16 --ratios same --reps 1 --budget-s 60
else
  if [ -z "${BENCH_ONLY:-}" ]; then
    echo "== GPU tests, t=$(($(date +%s) - T0)) s"
    timeout 180 python3 -m pytest -q -rs tests/gpu/test_gpu_runtime.py -p no:cacheprovider 2>&1 | tail -60 \
      | tee "$OUT/gpu-runtime.log"
  fi
  bench "${CHUNK_KIB:-8192}" --block-sizes 16 64 128 --reps 3 --budget-s "${BUDGET_S:-300}"
  if [ -n "${CHUNK2_KIB:-}" ]; then  # block 16 again with another chunk size
    BENCH_TIMEOUT=150 bench "$CHUNK2_KIB" --block-sizes 16 --reps 3 --budget-s 100
  fi
fi
echo "== done, t=$(($(date +%s) - T0)) s"
