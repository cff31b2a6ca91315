#!/usr/bin/env bash
# The closing device run of issue 11's session 23 (one call, <= 600 s): tune the points the side-by-side found
# weakest (seeded with vLLM's configs), re-run the side-by-side on the whole grid, the GPU kernel tests, and the
# whole-forward bench of Qwen3-30B-A3B decode against the previous session's results. Every step is time-capped
# so the call returns what finished. Needs carry/whl and carry/vllm033 (bench/get_vllm_triton.sh).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site carry/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
out=${OUT:-bench/results}/final
mkdir -p "$out"
tune() {  # tune SECONDS MODEL SCHEME... -- the Ms
  local secs=$1 model=$2; shift 2
  timeout "$secs" python3 bench/moe.py --phase tune --install-configs --peer-configs carry/vllm033 \
    --out "$out/tune/$model" --models "$model" "$@" 2>&1 | grep -v "^  skip" >> "$out/tune.log"
}
tune 60 mixtral-8x7b --schemes fp8_tensor --ms 1024 4096 16384
tune 80 deepseek-v3 --schemes fp8_block --ms 4096 16384
tune 45 qwen3-30b-a3b --schemes bf16 fp8_tensor --ms 4096 16384
tune 50 gpt-oss-120b --schemes mxfp4 --ms 2048 4096
timeout 175 python3 bench/vllm_triton.py --vllm-dir carry/vllm033 --out "$out/vllm_triton" > "$out/vllm_triton.log" 2>&1
timeout 110 python3 -m pytest tests/kernels -q -n 8 -p no:benchmark -p no:cacheprovider 2>&1 | tail -15 > "$out/pytest.log"
timeout 70 python3 bench/moe.py --phase bench --models qwen3-30b-a3b --schemes bf16 fp8_tensor --ms 1 16 256 --fast \
  --baseline bench/results/quant/new/results.json --out "$out/bench" > "$out/bench.log" 2>&1
rm -f "$out"/*/bench.csv
# A device run returns at most 8 files: the tuning (log, results, installed configs) travels as one archive.
cp -r kernels/configs "$out/tune/configs" && tar -czf "$out/tune.tgz" -C "$out" tune tune.log && rm -rf "$out/tune" "$out/tune.log"
tail -3 "$out/pytest.log"; tar -xzOf "$out/tune.tgz" tune.log | grep "^tuned" | cut -c1-90; tail -12 "$out/vllm_triton.log"
