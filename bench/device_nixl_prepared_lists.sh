#!/usr/bin/env bash
# On a GPU machine (one H200), the wheels in .whl/ (docs/benchmarks/device-runs.md), from the repository root:
#   bash bench/device_nixl_prepared_lists.sh
# 1. tests/gpu/test_gpu_runtime.py (the decode runtime: runtime/nixl_reads.py and ipc_reads.py);
# 2. bench/gpu_transfer.py, scattered and contiguous 8k-token requests, NIXL three ways side by side (per-request
#    initialize_xfer, prepared lists, one contiguous region of the same bytes), for each place of the prefill
#    agent on one GPU (--nixl-peer agent/self/process);
# 3. which UCX protocol each mode's READ got (UCX_PROTO_INFO=y, filtered) into proto.txt.
# Writes at most 8 files under $OUT (the device tool's limit).
# Its figures (docs/benchmarks/nixl-descriptors.md) come from its parts run one by one.
set -u
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 UCX_NET_DEVICES=lo VLLM_HOST_IP=127.0.0.1
nvidia-smi -L
python3 -c "import torch, nixl._api; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())"

echo "== tests/gpu/test_gpu_runtime.py"
timeout 200 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_gpu_runtime.py 2>&1 | tee "$OUT/gpu-runtime.log"

# Every READ here runs over UCX's tcp/lo software emulation (~0.3-0.5 GB/s, 1-2 s per 8k request): 2 repetitions.
COMMON=(--decode-gpu 0 --no-kernel --no-gather --tokens 8192 --blocks 1100 --min-reps 2 --reps 2 --budget-s 0.1
  --nixl-variants nixl nixl-prep nixl-contig)
echo "== UCX protocols (one small case per mode)"
for mode in agent self process; do
  echo "-- $mode" >>"$OUT/proto.txt"
  UCX_PROTO_INFO=y timeout 35 python3 bench/gpu_transfer.py "${COMMON[@]}" --pairs "pp1->pp1" --patterns contiguous \
    --nixl-variants nixl-contig --min-reps 1 --reps 1 --nixl-peer "$mode" --out /tmp/proto-$mode 2>&1 \
    | grep -i "get\*\|emulation\|cuda_ipc\|cuda_copy\|tcp/lo\|rkey_ptr" | sort | uniq -c | head -20 >>"$OUT/proto.txt"
done
cat "$OUT/proto.txt"

for mode in agent self; do
  echo "== gpu_transfer --nixl-peer $mode"
  timeout 100 python3 bench/gpu_transfer.py "${COMMON[@]}" --pairs "pp1->pp1" "pp2->tp2" --layouts LBHNC \
    --nixl-peer "$mode" --out "$OUT/$mode" 2>&1 | grep -v "NIXL INFO"
done
echo "== gpu_transfer --nixl-peer process (UCX between two processes on one GPU)"
timeout 70 python3 bench/gpu_transfer.py "${COMMON[@]}" --pairs "pp1->pp1" "pp2->tp2" --layouts LBHNC \
  --nixl-peer process --out "$OUT/process" 2>&1 | grep -v "NIXL INFO"
rm -f "$OUT"/*/gpu-*.log  # the benches' logs (their lines are on stdout); not gpu-runtime.log
ls -R "$OUT"
