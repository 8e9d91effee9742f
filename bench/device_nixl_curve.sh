#!/usr/bin/env bash
# On a GPU machine (one H200), the wheels in .whl/ (docs/benchmarks/device-runs.md), from the repository root:
#   bash bench/device_nixl_curve.sh
# 1. bench/nixl_curve.py in DRAM (UCX self,sm,cma,tcp between two processes): the GB/s curve,
#    block size 16/64/128 x TP same/2:1/1:2/4:1 x 8k/1k/32k tokens, kvbridge vs NixlConnector-style prepared lists
#    vs strided prepared lists vs the contiguous anchor;
# 2. the same in VRAM on the one GPU (UCX's software emulation over tcp/lo): a small slice;
# 3. bench/gpu_workers.py --paths nixl on one GPU (pp1->pp1, pp2->tp2): slow loads, not failed ones, and the
#    decode worker's one log line naming the emulated transport;
# 4. tests/gpu/test_gpu_runtime.py (the decode runtime with byte-scaled deadlines).
# UCX_TLS is set for step 1 because nixl-cu13 refuses self,sm,cma,tcp on a GPU machine (no CUDA transport)
# (docs/benchmarks/nixl-descriptors.md). As a whole, this script has not run in one call; its steps have.
set -u
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 UCX_NET_DEVICES=lo VLLM_HOST_IP=127.0.0.1
nvidia-smi -L
nproc
python3 -c "import torch, nixl._api; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())"
T0=$(date +%s)
echo "== 1. nixl_curve DRAM"
UCX_TLS=self,sm,cma,tcp,cuda_copy timeout 230 python3 bench/nixl_curve.py --mem DRAM --tokens 8192 1024 32768 --reps 2 --budget-s 170 --out "$OUT" 2>&1 \
  | grep -v "NIXL INFO" | tee "$OUT/curve-dram.log"
echo "== 2. nixl_curve VRAM (one GPU), t=$(($(date +%s) - T0)) s"
timeout 75 python3 bench/nixl_curve.py --mem VRAM --block-sizes 16 128 --ratios same --tokens 1024 8192 --reps 1 \
  --budget-s 45 --out "$OUT" 2>&1 | grep -v "NIXL INFO" | tee "$OUT/curve-vram.log"
echo "== 3. gpu_workers --paths nixl, one GPU, t=$(($(date +%s) - T0)) s"
timeout 110 python3 bench/gpu_workers.py --decode-gpu 0 --pairs "pp1->pp1" "pp2->tp2" --repeats 2 --paths nixl \
  --claims on --out "$OUT/workers" 2>&1 | grep -v "NIXL INFO" | tee "$OUT/workers-nixl.log" | tail -60
echo "== 4. tests/gpu/test_gpu_runtime.py, t=$(($(date +%s) - T0)) s"
timeout 100 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_gpu_runtime.py 2>&1 | tail -15 \
  | tee "$OUT/gpu-runtime.log"
echo "== done, t=$(($(date +%s) - T0)) s"
ls -R "$OUT"
