#!/usr/bin/env bash
# The GPU evidence for the kernels, in one device run (see bench/results/README.md for the wheels):
#   GPU pytest of tests/kernels (bf16 everywhere, the full decision walk), MX correctness at gpt-oss
#   shapes, and mxfp4/mxfp8 timings on gpt-oss-120b. Writes under $OUT/kernels.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site carry/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
out=${OUT:-bench/results}/kernels; mkdir -p "$out"
nvidia-smi -L | tee "$out/device.txt"
timeout 300 python3 -m pytest tests/kernels -q -p no:cacheprovider 2>&1 | tail -25 | tee "$out/log_pytest_gpu.txt"
timeout 120 python3 bench/moe.py --phase correctness --models gpt-oss-120b \
  --cells mxfp4_w4a16/group32 mxfp8/group32/group32 --out "$out" 2>&1 | tail -12 | tee "$out/log_mx_correctness.txt"
timeout 150 python3 bench/moe.py --phase bench --models gpt-oss-120b --schemes mxfp4 mxfp8 --fast --out "$out" 2>&1 \
  | tail -30 | tee "$out/log_mx_bench.txt"
