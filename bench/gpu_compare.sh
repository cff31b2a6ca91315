#!/usr/bin/env bash
# One device run: GPU pytest of tests/kernels, some scheme cells at real shapes against the fp32 reference,
# then bench/moe.py over the old code and this tree in the same session, this tree's rows with their ratio to
# the old ones. The old code travels as carry/base (`git archive BASE moerules kernels engine rules
# pyproject.toml | tar -x -C carry/base`); bench/moe.py is this tree's for both. Writes under $OUT/NAME
# (bench.csv dropped: a device run returns at most 8 files).
#   bash bench/gpu_compare.sh NAME "CORRECTNESS ARGS" "BENCH ARGS"
# e.g. bench/results/quant: bash bench/gpu_compare.sh quant "--models qwen3-30b-a3b --cells
#   fp8_w8a8/tensor/tensor fp8_w8a8/channel/token fp8_w8a8/block128/group128"
#   "--models qwen3-30b-a3b deepseek-v3 --ms 1 16 256 4096 --fast"
set -uo pipefail
name=$1 correctness=$2 bench=$3
python3 -m pip install -q --no-index --no-deps --target /tmp/site carry/whl/*.whl
export PYTHONUNBUFFERED=1
out=${OUT:-bench/results}/$name
mkdir -p "$out"
nvidia-smi -L | tee "$out/log.txt"
PYTHONPATH=/tmp/site:$PWD timeout "${PYTEST_TIMEOUT:-300}" python3 -m pytest tests/kernels -q -n 8 -p no:benchmark \
  -p no:cacheprovider 2>&1 | tail -25 | tee -a "$out/log.txt"
# shellcheck disable=SC2086
PYTHONPATH=/tmp/site:$PWD timeout 120 python3 bench/moe.py --phase correctness $correctness \
  --out "$out/correctness" 2>&1 | grep -E "^(ok|FAIL|BUILD)" | tee -a "$out/log.txt"
# shellcheck disable=SC2086
PYTHONPATH=/tmp/site:$PWD/carry/base timeout 150 python3 bench/moe.py --phase bench $bench --out "$out/base" 2>&1 \
  | tail -3 | tee -a "$out/log.txt"
# shellcheck disable=SC2086
PYTHONPATH=/tmp/site:$PWD timeout 150 python3 bench/moe.py --phase bench $bench --baseline "$out/base/results.json" \
  --out "$out/new" 2>&1 | tail -45 | tee -a "$out/log.txt"
rm -f "$out"/*/bench.csv
