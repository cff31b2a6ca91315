#!/usr/bin/env bash
# Session 47's second device call: whole HALF_MMA configs (BLOCK_M 128, GEMM1 128 x 256 weight rows) at DeepSeek-V3
# FP8 block-128 M=4096 and 16384, GEMMs alone; the fastest installed where it beats the config in use
# (bench/tma_probe.py --gemms --install --tile), then the grid against session 46's and the block-scale tests.
# Run from the repo root with OUT set (the device tool's $OUT).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site carry/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OUT_NAME=${OUT_NAME:-s47b}
gemm() {  # gemm BLOCK_N WARPS STAGES GROUP_M HALF TMA
  echo "{\"BLOCK_N\":$1,\"num_warps\":$2,\"num_stages\":$3,\"GROUP_M\":$4,\"HALF_MMA\":$5,\"TMA\":$6,\"BLOCK_K\":128,\"MAXNREG\":null,\"SWAP_AB\":false}"
}
tile() { echo "--tile=$1={\"BLOCK_M\":128,\"TAIL_M\":0,\"gemm1\":$2,\"gemm2\":$3}"; }
TMA_ARGS="--gemms --install --rounds 2 --points deepseek-v3:fp8_block:16384 deepseek-v3:fp8_block:4096
  $(tile s4s3 "$(gemm 128 8 4 8 true false)" "$(gemm 256 8 3 8 true false)")
  $(tile s3s3 "$(gemm 128 8 3 8 true false)" "$(gemm 256 8 3 8 true false)")
  $(tile s4w128 "$(gemm 128 8 4 8 true false)" "$(gemm 128 8 3 8 false false)")
  $(tile s4w128tma "$(gemm 128 8 4 8 true false)" "$(gemm 128 8 4 8 false true)")
  $(tile g16 "$(gemm 128 8 3 16 true false)" "$(gemm 256 8 3 16 true false)")
  $(tile g4 "$(gemm 128 8 4 4 true false)" "$(gemm 256 8 3 4 true false)")
  $(tile g32 "$(gemm 128 8 3 32 true false)" "$(gemm 256 8 3 32 true false)")"
export TMA_ARGS PROBE_SECONDS=${PROBE_SECONDS:-150}
bash bench/gpu_steps.sh tma_probe
grep '"point"' "$OUT/$OUT_NAME/tma_probe.log" | cut -c1-3000
HARNESS_ARGS="--rounds 2 --baseline bench/results/s46/a_grid/vllm_triton/results.json" HARNESS_SECONDS=${HARNESS_SECONDS:-260} \
  bash bench/gpu_steps.sh harness
tail -12 "$OUT/$OUT_NAME/vllm_triton.log"
timeout "${TESTS_SECONDS:-90}" python3 -m pytest -q -p no:benchmark -p no:cacheprovider -n 8 \
  tests/kernels/test_block_scales.py > "$OUT/$OUT_NAME/block_scale_tests.log" 2>&1
tail -3 "$OUT/$OUT_NAME/block_scale_tests.log"
