#!/usr/bin/env bash
# session 45 decode tile probe (not committed)
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site carry/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
out=$OUT/b_tiles; mkdir -p $out
timeout 420 python3 bench/tma_probe.py --out $out --gemms --rounds 3 \
  --points qwen3-30b-a3b:bf16:1 qwen3-30b-a3b:fp8_tensor:1 gpt-oss-120b:bf16:1 \
  --tile 'g1k256s3={"gemm1": {"BLOCK_K": 256, "num_stages": 3}}' \
  --tile 'g1n16k256s4={"gemm1": {"BLOCK_N": 16, "BLOCK_K": 256, "num_stages": 4}}' \
  --tile 'g1n16k512s3={"gemm1": {"BLOCK_N": 16, "BLOCK_K": 512, "num_stages": 3}}' \
  --tile 'g1n16k512s2={"gemm1": {"BLOCK_N": 16, "BLOCK_K": 512, "num_stages": 2}}' \
  --tile 'g1n32k512s2={"gemm1": {"BLOCK_N": 32, "BLOCK_K": 512, "num_stages": 2}}' \
  --tile 'g1n16k1024s2={"gemm1": {"BLOCK_N": 16, "BLOCK_K": 1024, "num_stages": 2}}' \
  --tile 'g1n16k512s3w={"gemm1": {"BLOCK_N": 16, "BLOCK_K": 512, "num_stages": 3, "SWAP_AB": true}}' \
  --tile 'g2k256s3={"gemm2": {"BLOCK_K": 256, "num_stages": 3}}' \
  --tile 'g2n32k256s4={"gemm2": {"BLOCK_N": 32, "BLOCK_K": 256, "num_stages": 4}}' \
  --tile 'g2n16k512s2={"gemm2": {"BLOCK_N": 16, "BLOCK_K": 512, "num_stages": 2}}' \
  --tile 'g2n32k512s2={"gemm2": {"BLOCK_N": 32, "BLOCK_K": 512, "num_stages": 2}}' \
  --tile 'g2n16k256s4w={"gemm2": {"BLOCK_N": 16, "BLOCK_K": 256, "num_stages": 4, "SWAP_AB": true}}' \
  > $out/tile_probe.log 2>&1
tail -5 $out/tile_probe.log
