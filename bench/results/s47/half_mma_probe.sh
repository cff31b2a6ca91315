#!/usr/bin/env bash
# Session 47's device call: GEMM1 / GEMM2 alone with two promoted halves per K step (GemmConfig.HALF_MMA) at
# DeepSeek-V3 FP8 block-128, against the config in use (bench/tma_probe.py --gemms --tile), then the block-scale
# tests on the GPU. Run from the repo root with OUT set (the device tool's $OUT).
set -uo pipefail
plain='"TMA":false,"MAXNREG":null,"HALF_MMA":true,"BLOCK_K":128,"GROUP_M":8'
tile() {  # tile NAME BLOCK_M N1 WARPS1 STAGES1 N2 WARPS2 STAGES2 [extra fields of both GEMMs]
  echo "--tile=$1={\"BLOCK_M\":$2,\"gemm1\":{$plain,\"BLOCK_N\":$3,\"num_warps\":$4,\"num_stages\":$5${9:-}},\"gemm2\":{$plain,\"BLOCK_N\":$6,\"num_warps\":$7,\"num_stages\":$8${9:-}}}"
}
export OUT_NAME=${OUT_NAME:-s47} PROBE_SECONDS=${PROBE_SECONDS:-420}
TMA_ARGS="--gemms --rounds 2 --points ${POINTS:-deepseek-v3:fp8_block:4096 deepseek-v3:fp8_block:16384 deepseek-v3:fp8_block:1024}
  $(tile h256 128 128 8 3 256 8 3) $(tile h256s4 128 128 8 4 256 8 4) $(tile h128 128 64 8 4 128 8 4)
  $(tile h128tma 128 64 8 4 128 8 4 ',"TMA":true') $(tile m64h256 64 128 8 3 256 8 3)"
export TMA_ARGS
bash bench/gpu_steps.sh tma_probe
tail -40 "$OUT/$OUT_NAME/tma_probe.log"
timeout "${TESTS_SECONDS:-150}" python3 -m pytest -q -p no:benchmark -p no:cacheprovider -n 8 \
  tests/kernels/test_block_scales.py > "$OUT/$OUT_NAME/block_scale_tests.log" 2>&1
tail -5 "$OUT/$OUT_NAME/block_scale_tests.log"
