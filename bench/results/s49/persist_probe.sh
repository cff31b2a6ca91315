#!/usr/bin/env bash
# Session 49's first device call: persistent GEMMs (GemmConfig.PERSISTENT). The new tests with the amax, block-scale
# and PDL ones on the GPU, then the GEMMs alone (tma_probe --gemms, interleaved, 2 rounds) at the compute-bound points,
# largest headroom against vLLM first (bench/results/s48/b_grid), each with both GEMMs persistent at 1 and 2 programs
# per SM (no tail tiles or GEMM2 row tiles: persistent launches run whole BLOCK_M tiles) and, as the control, the
# config in use without its tail tiles. The fastest variant at least TILE_INSTALL_MARGIN faster goes into the files
# (they come back in probe.tgz's configs/). Run from the repo root with OUT set; POINTS overrides the points.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site carry/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
out=$OUT/${OUT_NAME:-a_persist}
mkdir -p "$out"
if [ "${TESTS_SECONDS:-90}" -gt 0 ]; then  # TESTS_SECONDS=0: no tests
  timeout "${TESTS_SECONDS:-90}" python3 -m pytest tests/kernels/test_persistent.py tests/kernels/test_block_scales.py \
    tests/kernels/test_sorted_intermediate.py tests/kernels/test_pdl.py -q -n 8 -p no:benchmark -p no:cacheprovider \
    2>&1 | tail -15 > "$out/pytest.log"
  tail -3 "$out/pytest.log"
fi
persistent() { echo "{\"TAIL_M\":0,\"GEMM2_BLOCK_M\":0,\"gemm1\":{\"PERSISTENT\":$1},\"gemm2\":{\"PERSISTENT\":$1}}"; }
# shellcheck disable=SC2086
timeout "${PROBE_SECONDS:-420}" python3 bench/tma_probe.py --out "$out/probe" --gemms --install --rounds 2 \
  --points ${POINTS:-deepseek-v3:fp8_tensor:4096 qwen3-30b-a3b:fp8_tensor:4096 qwen3-30b-a3b:bf16:4096
  qwen3-30b-a3b:fp8_tensor:16384 qwen3-30b-a3b:bf16:16384 deepseek-v3:bf16:4096 mixtral-8x7b:fp8_tensor:4096
  mixtral-8x7b:fp8_tensor:16384 gpt-oss-120b:bf16:4096 gpt-oss-120b:fp8_tensor:4096 deepseek-v3:fp8_tensor:16384
  gpt-oss-120b:bf16:16384 gpt-oss-120b:fp8_tensor:16384 deepseek-v3:bf16:16384 mixtral-8x7b:bf16:4096
  mixtral-8x7b:bf16:16384 deepseek-v3:fp8_block:4096 deepseek-v3:fp8_block:16384} \
  --tile="p1=$(persistent 1)" --tile="p2=$(persistent 2)" --tile='notail={"TAIL_M":0,"GEMM2_BLOCK_M":0}' \
  > "$out/probe.log" 2>&1
grep '"point"' "$out/probe.log" | cut -c1-700
mkdir -p "$out/configs" && cp kernels/configs/*"$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' _)"* "$out/configs/"
tar -czf "$out/probe.tgz" -C "$out" probe configs && rm -rf "$out/probe" "$out/configs"
