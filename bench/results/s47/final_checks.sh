#!/usr/bin/env bash
# Session 47's third device call: the GPU kernel tests after HALF_MMA (GEMM2's tile body was refactored for every
# scheme), then DeepSeek-V3 FP8 block-128 M=16384's whole forward, the installed HALF_MMA entry against session 46's.
# On an H200 the probe is the H100's HALF_MMA entry against the H200's own (GEMMs alone, --install).
# Run from the repo root with OUT set (the device tool's $OUT).
set -uo pipefail
export OUT_NAME=${OUT_NAME:-s47c} TESTS_SECONDS=${TESTS_SECONDS:-300} PROBE_SECONDS=${PROBE_SECONDS:-120}
old_g1='{"BLOCK_N":128,"BLOCK_K":128,"GROUP_M":16,"num_warps":8,"num_stages":3,"TMA":false,"HALF_MMA":false}'
old_g2='{"BLOCK_N":128,"BLOCK_K":128,"GROUP_M":8,"num_warps":4,"num_stages":3,"TMA":true,"HALF_MMA":false}'
export TMA_ARGS="--rounds 3 --points deepseek-v3:fp8_block:16384 --tile=s46={\"BLOCK_M\":64,\"gemm1\":$old_g1,\"gemm2\":$old_g2}"
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  # on an H200 instead: the H100's HALF_MMA entry against the H200's own, GEMMs alone, installed where faster
  half_g1='{"BLOCK_N":128,"BLOCK_K":128,"GROUP_M":4,"num_warps":8,"num_stages":4,"TMA":false,"MAXNREG":null,"HALF_MMA":true}'
  half_g2='{"BLOCK_N":256,"BLOCK_K":128,"GROUP_M":4,"num_warps":8,"num_stages":3,"TMA":false,"MAXNREG":null,"HALF_MMA":true}'
  export TMA_ARGS="--gemms --install --rounds 2 --points deepseek-v3:fp8_block:16384 deepseek-v3:fp8_block:4096
    --tile=h100={\"BLOCK_M\":128,\"TAIL_M\":0,\"gemm1\":$half_g1,\"gemm2\":$half_g2}"
fi
bash bench/gpu_steps.sh tests tma_probe
cat "$OUT/$OUT_NAME/pytest.log"
grep '"point"' "$OUT/$OUT_NAME/tma_probe.log"
