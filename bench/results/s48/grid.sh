#!/usr/bin/env bash
# Session 48's grid call: the GPU kernel tests, then the side-by-side with vLLM 0.33 on the whole grid (2 rounds)
# against session 47's (b_installed), with the split probe's installs in the files. Run from the repo root, OUT set.
set -uo pipefail
export OUT_NAME=${OUT_NAME:-b_grid} TESTS_SECONDS=${TESTS_SECONDS:-230} HARNESS_SECONDS=${HARNESS_SECONDS:-300}
export HARNESS_ARGS=${HARNESS_ARGS:-"--rounds 2 --baseline bench/results/s47/b_installed/vllm_triton/results.json"}
bash bench/gpu_steps.sh tests harness
tail -4 "$OUT/$OUT_NAME/pytest.log"
grep -c "^ok" "$OUT/$OUT_NAME/vllm_triton.log"; grep "^FAIL" "$OUT/$OUT_NAME/vllm_triton.log"
sed -n '/| geomean/,$p' "$OUT/$OUT_NAME/vllm_triton/vllm_triton.md"
