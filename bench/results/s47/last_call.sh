#!/usr/bin/env bash
# Session 47's last device call: the GPU kernel tests on the final code, DeepSeek-V3 FP8 block-128 M=4096's GEMMs
# with the new entry against session 46's (interleaved A/B, 3 rounds), and the grid against this session's first.
# On an H200: the tests, the H100's HALF_MMA entries against the H200's, and the block-128 side-by-side.
# Run from the repo root with OUT set (the device tool's $OUT).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site carry/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export OUT_NAME=${OUT_NAME:-s47d} TESTS_SECONDS=${TESTS_SECONDS:-240} PROBE_SECONDS=${PROBE_SECONDS:-90}
s46_g1='{"BLOCK_N":64,"BLOCK_K":128,"GROUP_M":32,"num_warps":4,"num_stages":3,"TMA":true,"MAXNREG":168,"HALF_MMA":false}'
s46_g2='{"BLOCK_N":128,"BLOCK_K":128,"GROUP_M":16,"num_warps":4,"num_stages":3,"TMA":true,"MAXNREG":168,"HALF_MMA":false}'
export TMA_ARGS="--gemms --rounds 3 --points deepseek-v3:fp8_block:4096 --tile=s46={\"BLOCK_M\":64,\"gemm1\":$s46_g1,\"gemm2\":$s46_g2}"
export HARNESS_ARGS=${HARNESS_ARGS:-"--rounds 2 --baseline bench/results/s47/b_installed/vllm_triton/results.json"} HARNESS_SECONDS=${HARNESS_SECONDS:-230}
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  # on an H200 instead: the H100's HALF_MMA entries against the H200's own (GEMMs alone, installed where faster),
  # then the side-by-side at the block-128 points
  gemm() { echo "{\"BLOCK_N\":$1,\"num_warps\":8,\"num_stages\":$2,\"GROUP_M\":4,\"HALF_MMA\":true,\"TMA\":$3,\"MAXNREG\":$4,\"BLOCK_K\":128,\"SWAP_AB\":false}"; }
  tile() { echo "--tile=$1={\"BLOCK_M\":128,\"TAIL_M\":0,\"gemm1\":$2,\"gemm2\":$3}"; }
  export TMA_ARGS="--gemms --install --rounds 2 --points deepseek-v3:fp8_block:16384 deepseek-v3:fp8_block:4096
    $(tile h100_16384 "$(gemm 128 4 false null)" "$(gemm 256 3 false null)")
    $(tile h100_4096 "$(gemm 128 4 false null)" "$(gemm 128 3 true 128)")"
  HARNESS_ARGS="--rounds 2 --models deepseek-v3 --schemes fp8_block --ms 1024 4096 16384"
fi
bash bench/gpu_steps.sh tests tma_probe harness
cat "$OUT/$OUT_NAME/pytest.log" | tail -4
grep '"point"' "$OUT/$OUT_NAME/tma_probe.log"
grep -c "^ok" "$OUT/$OUT_NAME/vllm_triton.log"; grep "^FAIL" "$OUT/$OUT_NAME/vllm_triton.log"
sed -n '/| geomean/,$p' "$OUT/$OUT_NAME/vllm_triton/vllm_triton.md"
