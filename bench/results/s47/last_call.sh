#!/usr/bin/env bash
# Session 47's last device call: the GPU kernel tests on the final code, DeepSeek-V3 FP8 block-128 M=4096's GEMMs
# with the new entry against session 46's (interleaved A/B, 3 rounds), and the grid against this session's first.
# Run from the repo root with OUT set (the device tool's $OUT).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site carry/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export OUT_NAME=${OUT_NAME:-s47d} TESTS_SECONDS=${TESTS_SECONDS:-240} PROBE_SECONDS=${PROBE_SECONDS:-90}
s46_g1='{"BLOCK_N":64,"BLOCK_K":128,"GROUP_M":32,"num_warps":4,"num_stages":3,"TMA":true,"MAXNREG":168,"HALF_MMA":false}'
s46_g2='{"BLOCK_N":128,"BLOCK_K":128,"GROUP_M":16,"num_warps":4,"num_stages":3,"TMA":true,"MAXNREG":168,"HALF_MMA":false}'
export TMA_ARGS="--gemms --rounds 3 --points deepseek-v3:fp8_block:4096 --tile=s46={\"BLOCK_M\":64,\"gemm1\":$s46_g1,\"gemm2\":$s46_g2}"
HARNESS_ARGS="--rounds 2 --baseline bench/results/s47/b_installed/vllm_triton/results.json" HARNESS_SECONDS=230 \
  bash bench/gpu_steps.sh tests tma_probe harness
cat "$OUT/$OUT_NAME/pytest.log" | tail -4
grep '"point"' "$OUT/$OUT_NAME/tma_probe.log"
grep -c "^ok" "$OUT/$OUT_NAME/vllm_triton.log"; grep "^FAIL" "$OUT/$OUT_NAME/vllm_triton.log"
sed -n '/| geomean/,$p' "$OUT/$OUT_NAME/vllm_triton/vllm_triton.md"
