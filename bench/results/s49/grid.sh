#!/usr/bin/env bash
# Session 49's second device call: persistent GEMMs probed at the M=1024 points as persist_probe.sh did at M >= 4096
# (installed where faster), then the side-by-side with vLLM 0.33 on the whole grid (2 rounds) against session 48's
# (b_grid). Run from the repo root with OUT set, after copying the first call's configs into kernels/configs.
set -uo pipefail
export OUT_NAME=${OUT_NAME:-b_grid} HARNESS_SECONDS=${HARNESS_SECONDS:-300}
export HARNESS_ARGS=${HARNESS_ARGS:-"--rounds 2 --baseline bench/results/s48/b_grid/vllm_triton/results.json"}
if [ "${PROBE_SECONDS:-150}" -gt 0 ]; then
  OUT_NAME=b_persist_1024 TESTS_SECONDS=0 POINTS="mixtral-8x7b:fp8_tensor:1024 qwen3-30b-a3b:bf16:1024
    qwen3-30b-a3b:fp8_tensor:1024 deepseek-v3:fp8_block:1024 gpt-oss-120b:bf16:1024 deepseek-v3:bf16:1024
    deepseek-v3:fp8_tensor:1024 mixtral-8x7b:bf16:1024 gpt-oss-120b:fp8_tensor:1024" \
    PROBE_SECONDS=${PROBE_SECONDS:-150} bash bench/results/s49/persist_probe.sh
  tar -xzf "$OUT/b_persist_1024/probe.tgz" -C /tmp configs && cp /tmp/configs/*.json kernels/configs/
fi
bash bench/gpu_steps.sh harness
grep -c "^ok" "$OUT/$OUT_NAME/vllm_triton.log"; grep "^FAIL" "$OUT/$OUT_NAME/vllm_triton.log"
sed -n '/| geomean/,$p' "$OUT/$OUT_NAME/vllm_triton/vllm_triton.md"
