#!/usr/bin/env bash
# Session 48's first device call: GEMM2's own row tiles (MoEConfig.GEMM2_BLOCK_M). The new tests on the GPU, then
# the GEMMs alone (tma_probe --gemms, interleaved, 2 rounds) at the M >= 4096 points, largest expected gain first,
# with GEMM2 on half and quarter row tiles (tails kept where no longer than those), and on half tiles at 4 warps;
# at DeepSeek-V3 block-128 M=4096 also session 46's 64-row GEMM2 tile under GEMM1's 128-row one (on an H200, whose
# block-128 entries are 64-row, the H100's 128-row ones at M=4096 and 16384 and that split). The fastest variant
# at least TILE_INSTALL_MARGIN faster goes into the files (tma_probe/configs). Run from the repo root with OUT set.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site carry/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
out=$OUT/${OUT_NAME:-a_split}
mkdir -p "$out"
timeout "${TESTS_SECONDS:-80}" python3 -m pytest tests/kernels/test_gemm2_row_tiles.py tests/kernels/test_block_scales.py \
  tests/kernels/test_sorted_intermediate.py tests/kernels/test_pdl.py -q -n 8 -p no:benchmark -p no:cacheprovider 2>&1 \
  | tail -15 > "$out/pytest.log"
tail -3 "$out/pytest.log"
s46_g2='{"BLOCK_N":128,"BLOCK_K":128,"GROUP_M":16,"num_warps":4,"num_stages":3,"TMA":true,"MAXNREG":168,"HALF_MMA":false}'
probe() {  # probe NAME SECONDS POINTS [--tile ...]: the split variants (and any further tiles) at POINTS
  local name=$1 secs=$2 points=$3
  shift 3
  # shellcheck disable=SC2086
  timeout "$secs" python3 bench/tma_probe.py --out "$out/$name" --gemms --install --rounds 2 --points $points \
    --tile='g64={"GEMM2_BLOCK_M":64}' --tile='g32={"GEMM2_BLOCK_M":32}' \
    --tile='g64w4={"GEMM2_BLOCK_M":64,"gemm2":{"num_warps":4,"MAXNREG":null}}' "$@" > "$out/$name.log" 2>&1
  grep '"point"' "$out/$name.log" | cut -c1-600
}
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  # the H200's block-128 entries are 64-row: the H100's 128-row HALF_MMA entries (session 47), and the M=4096 one
  # with GEMM2 on session 46's 64-row tile, against them
  gemm() { echo "{\"BLOCK_N\":$1,\"num_warps\":8,\"num_stages\":$2,\"GROUP_M\":4,\"HALF_MMA\":true,\"TMA\":$3,\"MAXNREG\":$4,\"BLOCK_K\":128,\"SWAP_AB\":false}"; }
  tile() { echo "--tile=$1={\"BLOCK_M\":128,\"TAIL_M\":0,\"gemm1\":$2,\"gemm2\":$3$4}"; }
  probe block 160 "deepseek-v3:fp8_block:4096 deepseek-v3:fp8_block:16384" \
    "$(tile h100_16384 "$(gemm 128 4 false null)" "$(gemm 256 3 false null)")" \
    "$(tile h100_4096 "$(gemm 128 4 false null)" "$(gemm 128 3 true 128)")" \
    "$(tile h100_4096_s46g2 "$(gemm 128 4 false null)" "$s46_g2" ',"GEMM2_BLOCK_M":64')"
else
  probe block 100 deepseek-v3:fp8_block:4096 --tile="s46g2={\"GEMM2_BLOCK_M\":64,\"gemm2\":$s46_g2}"
fi
# largest padding cut first (bench/results/s48/padding.txt); points whose tails already cut it come last
probe m4096 "${PROBE_SECONDS:-260}" "deepseek-v3:bf16:4096 deepseek-v3:fp8_block:16384 deepseek-v3:bf16:16384
  gpt-oss-120b:bf16:16384 deepseek-v3:fp8_tensor:16384 qwen3-30b-a3b:bf16:16384 qwen3-30b-a3b:fp8_tensor:16384
  gpt-oss-120b:fp8_tensor:4096 qwen3-30b-a3b:bf16:4096 mixtral-8x7b:fp8_tensor:4096 gpt-oss-120b:fp8_tensor:16384"
mkdir -p "$out/configs" && cp kernels/configs/*"$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' _)"* "$out/configs/"
tar -czf "$out/probe.tgz" -C "$out" block m4096 configs && rm -rf "$out/block" "$out/m4096" "$out/configs"
