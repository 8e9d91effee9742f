#!/usr/bin/env bash
# The staged NIXL path on a GPU machine (one H200, host DRAM; the wheels in .whl/, docs/benchmarks/device-runs.md;
# from the repository root):  bash bench/device_nixl_staged_dram.sh
# bench/nixl_staged.py: direct vs staged vs the one-descriptor anchor, side by side, scattered 8k-token requests,
# block 16/64/128 x TP same/2:1/1:2/4:1, between two processes, twice: UCX cma (self,sm,cma,tcp) and UCX tcp on
# loopback only; cuda_copy is in both UCX_TLS because nixl-cu13 refuses a UCX_TLS without a CUDA transport on a GPU
# host (docs/benchmarks/staged-path.md). JSONs land in $OUT (default bench/out), with the command and the machine.
set -u
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 UCX_NET_DEVICES=lo VLLM_HOST_IP=127.0.0.1
nproc
T0=$(date +%s)
for TLS in self,sm,cma,tcp,cuda_copy tcp,cuda_copy; do
  echo "== nixl_staged UCX_TLS=$TLS, t=$(($(date +%s) - T0)) s"
  UCX_TLS=$TLS timeout 280 python3 bench/nixl_staged.py --tokens 8192 --reps 3 --budget-s 200 --out "$OUT" 2>&1 \
    | grep -v "NIXL INFO" | tee "$OUT/staged-${TLS%%,*}.log"
done
