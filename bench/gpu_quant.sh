#!/usr/bin/env bash
# The evidence for the activation quantisers (issue 11 items 1 and 7, issue 12) in one device run: GPU pytest
# of tests/kernels, the FP8 cells at Qwen3-30B-A3B shapes against the fp32 reference, then bench/moe.py over
# the old code and this tree in the same session, this tree's rows with their ratio to the old ones.
# The old code travels as carry/base: `git archive BASE moerules kernels engine rules pyproject.toml`.
# Writes under $OUT/quant (bench.csv dropped: the device run returns at most 8 files).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site carry/whl/*.whl
export PYTHONUNBUFFERED=1
out=${OUT:-bench/results}/quant
mkdir -p "$out"
nvidia-smi -L | tee "$out/log.txt"
PYTHONPATH=/tmp/site:$PWD timeout 130 python3 -m pytest tests/kernels -q -p no:cacheprovider 2>&1 | tail -25 \
  | tee -a "$out/log.txt"
PYTHONPATH=/tmp/site:$PWD timeout 80 python3 bench/moe.py --phase correctness --models qwen3-30b-a3b \
  --cells fp8_w8a8/tensor/tensor fp8_w8a8/channel/token fp8_w8a8/block128/group128 --out "$out/correctness" 2>&1 \
  | grep -E "^(ok|FAIL|BUILD)" | tee -a "$out/log.txt"
bench="--phase bench --models qwen3-30b-a3b deepseek-v3 --ms 1 16 256 4096 --fast"
# shellcheck disable=SC2086
PYTHONPATH=/tmp/site:$PWD/carry/base timeout 160 python3 bench/moe.py $bench --out "$out/base" 2>&1 | tail -3 \
  | tee -a "$out/log.txt"
# shellcheck disable=SC2086
PYTHONPATH=/tmp/site:$PWD timeout 160 python3 bench/moe.py $bench --baseline "$out/base/results.json" \
  --out "$out/new" 2>&1 | tail -40 | tee -a "$out/log.txt"
rm -f "$out"/*/bench.csv
