#!/usr/bin/env bash
# Session 47's last device call: the GPU kernel tests after HALF_MMA (GEMM2's tile body was refactored for every
# scheme), then HALF_MMA tiles capped at 128 registers (two 8-warp programs per SM; TMA weights, so nothing spills:
# bench/sass_count.py): 128 x 128, and 64 x 256 on 2 stages, at DeepSeek-V3 FP8 block-128, GEMMs alone, installed
# where faster, and the side-by-side at the block-128 points. On an H200 the probe is the H100's HALF_MMA entry against the H200's own instead.
# Run from the repo root with OUT set (the device tool's $OUT).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site carry/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export OUT_NAME=${OUT_NAME:-s47c} TESTS_SECONDS=${TESTS_SECONDS:-300} PROBE_SECONDS=${PROBE_SECONDS:-200}
gemm() {  # gemm BLOCK_N STAGES GROUP_M HALF TMA MAXNREG (8 warps, BLOCK_K 128)
  echo "{\"BLOCK_N\":$1,\"num_warps\":8,\"num_stages\":$2,\"GROUP_M\":$3,\"HALF_MMA\":$4,\"TMA\":$5,\"MAXNREG\":$6,\"BLOCK_K\":128,\"SWAP_AB\":false}"
}
tile() { echo "--tile=$1={\"BLOCK_M\":${4:-128},\"TAIL_M\":0,\"gemm1\":$2,\"gemm2\":$3}"; }  # NAME G1 G2 [BLOCK_M]
points="deepseek-v3:fp8_block:4096 deepseek-v3:fp8_block:16384 deepseek-v3:fp8_block:1024"
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  TMA_ARGS="--gemms --install --rounds 2 --points $points
    $(tile h100 "$(gemm 128 4 4 true false null)" "$(gemm 256 3 4 true false null)")"
else
  TMA_ARGS="--gemms --install --rounds 2 --points $points
    $(tile c128t "$(gemm 64 3 8 true true 128)" "$(gemm 128 3 8 true true 128)")
    $(tile c128tg4 "$(gemm 64 3 4 true true 128)" "$(gemm 128 3 4 true true 128)")
    $(tile c128tg16 "$(gemm 64 3 16 true true 128)" "$(gemm 128 3 16 true true 128)")
    $(tile c128 "$(gemm 64 3 8 true false 128)" "$(gemm 128 3 8 true false 128)")
    $(tile h256c128t "$(gemm 128 4 4 true false null)" "$(gemm 128 3 4 true true 128)")
    $(tile m64c "$(gemm 128 2 8 true true 128)" "$(gemm 256 2 8 true true 128)" 64)"
fi
export TMA_ARGS
bash bench/gpu_steps.sh tests tma_probe
cat "$OUT/$OUT_NAME/pytest.log"
grep '"point"' "$OUT/$OUT_NAME/tma_probe.log"
HARNESS_ARGS="--rounds 2 --models deepseek-v3 --schemes fp8_block --ms 1024 4096 16384" HARNESS_SECONDS=120 \
  bash bench/gpu_steps.sh harness
grep "^ok\|^FAIL" "$OUT/$OUT_NAME/vllm_triton.log"
