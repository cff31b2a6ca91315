#!/usr/bin/env bash
# Session 49's second device call. Persistent GEMMs lost at every compute-bound point in the first call (a_persist)
# with A gathered by address; session 46's persistent probe had gained 2.4% on GEMM2 with A as a TMA box of a sorted
# intermediate. So: GEMM2 persistent on the sorted intermediate, A and weights by TMA (GEMM1 as in use), GEMMs alone
# (2 rounds, installed where faster), and session 48's swapped 32-row GEMM2 tile at DeepSeek-V3 M=4096; then, if
# anything was installed, the side-by-side with vLLM 0.33 on the whole grid (2 rounds) against session 48's. Run from
# the repo root with OUT set.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site carry/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
out=$OUT/b_sorted_persist
mkdir -p "$out"
before=$(cat kernels/configs/*H100* | md5sum)
sorted='{"TAIL_M":0,"GEMM2_BLOCK_M":0,"SORTED_INTER":true,"gemm2":{"TMA":true,"PERSISTENT":1}}'
# shellcheck disable=SC2086
timeout "${PROBE_SECONDS:-200}" python3 bench/tma_probe.py --out "$out/probe" --gemms --install --rounds 2 \
  --points ${POINTS:-qwen3-30b-a3b:bf16:4096 qwen3-30b-a3b:bf16:16384 deepseek-v3:bf16:16384 gpt-oss-120b:bf16:4096
  deepseek-v3:bf16:4096 mixtral-8x7b:bf16:4096 qwen3-30b-a3b:fp8_tensor:4096 deepseek-v3:fp8_tensor:4096
  mixtral-8x7b:bf16:16384 mixtral-8x7b:fp8_tensor:4096} \
  --tile="sp1=$sorted" --tile='sorted={"TAIL_M":0,"GEMM2_BLOCK_M":0,"SORTED_INTER":true,"gemm2":{"TMA":true}}' \
  > "$out/probe.log" 2>&1
grep '"point"' "$out/probe.log" | cut -c1-500
# session 48's open probe: GEMM2 on 32-row tiles swapped (tokens on the N side: wgmma, 60 registers, static count)
timeout 80 python3 bench/tma_probe.py --out "$out/probe32" --gemms --install --rounds 2 \
  --points deepseek-v3:bf16:4096 deepseek-v3:fp8_block:4096 --tile='g32swap={"GEMM2_BLOCK_M":32,"gemm2":{"SWAP_AB":true}}' \
  > "$out/probe32.log" 2>&1
grep '"point"' "$out/probe32.log" | cut -c1-500
mkdir -p "$out/configs" && cp kernels/configs/*H100* "$out/configs/"
tar -czf "$out/probe.tgz" -C "$out" probe probe32 configs && rm -rf "$out/probe" "$out/probe32" "$out/configs"
if [ "$(cat kernels/configs/*H100* | md5sum)" = "$before" ]; then echo "nothing installed: no grid"; exit 0; fi
export OUT_NAME=b_grid HARNESS_SECONDS=${HARNESS_SECONDS:-300}
export HARNESS_ARGS="--rounds 2 --baseline bench/results/s48/b_grid/vllm_triton/results.json"
bash bench/gpu_steps.sh harness
grep -c "^ok" "$OUT/$OUT_NAME/vllm_triton.log"; grep "^FAIL" "$OUT/$OUT_NAME/vllm_triton.log"
sed -n '/| geomean/,$p' "$OUT/$OUT_NAME/vllm_triton/vllm_triton.md"
