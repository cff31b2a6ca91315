#!/usr/bin/env bash
# Issue 11's device runs (each call <= 600 s): the steps named on the command line, in order.
#   tests     the GPU kernel tests (tests_tiles: only the tile-variant ones)
#   harness   the side-by-side with vLLM 0.33's Triton GEMMs on the whole grid (bench/vllm_triton.py; HARNESS_ARGS
#             adds its options, e.g. --per-gemm, HARNESS_SECONDS caps it)
#   tune      tune TUNE_POINTS (model:scheme:M; default the weakest of the last side-by-side), TUNE_SECONDS each
#             (its sweep ends TUNE_MARGIN, default 30, s before, keeping the best so far),
#             seeded with vLLM's configs, the neighbouring M's entries and every GPU's entry at the point; installs
#             the configs
#   recheck   the side-by-side again on Mixtral (the model tuned most)
#   bench     the whole-forward bench of Qwen3-30B-A3B decode against the previous session's results
#   decode    tune the decode points with at most one row per expert, where the GEMV (BLOCK_M 1) seeds join (and
#             the chained launch, CHAIN, where the naive assignment holds)
#   tune_all  tune every point of the grid for this GPU (e.g. a first H200 set), model by model: TUNE_MODELS
#             (default all four), TUNE_SECONDS per model (default 140), TUNE_SCHEMES and TUNE_MS (default the whole M grid) fit it
#             into several calls; TUNE_ARGS adds bench/moe.py options (e.g. --fields TMA num_stages)
#   tests_mx  the MX kernel tests alone, with the MX cells' tile variants and decision-walk layers (the bf16 MXFP4
#             decode's PTX runs only here)
#   compare   the whole forward of the code in carry/base (`git archive BASE moerules kernels engine rules bench
#             pyproject.toml | tar -x -C carry/base`, timed by its own bench/moe.py, which may import names this
#             tree has renamed) and of this tree, in one session, this tree's rows with their ratio to the base's:
#             COMPARE_MODELS (default both gpt-oss), COMPARE_SCHEMES (default mxfp4), COMPARE_MS (default 16 256
#             4096), COMPARE_NAME (default compare) names the output, COMPARE_SECONDS (default 100) caps each side
#   compare_gemms  the side-by-side with vLLM 0.33 (--per-gemm, 2 rounds) run by the code in carry/base, then by this
#             tree, on COMPARE_MODELS x COMPARE_SCHEMES (default bf16 fp8_tensor) x COMPARE_MS: our GEMMs old and new,
#             each against vLLM's timed in the same run (the clock's drift between the two runs cancels in the ratio)
#   tk        MXFP4 against triton_kernels (bench/tk_mxfp4.py, 2 rounds; TK_ARGS adds options, TK_NAME names the
#             output, TK_SECONDS caps it); needs carry/triton_kernels (bench/get_triton_kernels.sh)
#   profile_mx  ncu (hardware counters, clocks left alone) of triton_kernels' and our MXFP4 GEMMs, once each, on
#             PROFILE_MODELS (default gpt-oss-120b) at PROFILE_MS (default 256): bench/tk_mxfp4.py --profile
#   profile_vllm  ncu of vLLM 0.33's two Triton GEMMs and ours, once each, at PROFILE_POINTS (model:scheme:M, default
#             the weakest side-by-side points): bench/vllm_triton.py --profile; PROFILE_SECONDS caps each point
#   gemv_probe  which fragment-order MXFP4 GEMV tiles compute right (bench/fp4_gemv_probe.py)
#   tune_mx   tune TUNE_MX_SCHEMES (default mxfp4) on TUNE_MX_MODELS (default both gpt-oss) at TUNE_MS (default 16 64
#             256), TUNE_SECONDS each; TUNE_ARGS adds bench/moe.py options (e.g. --seeds-only)
#   decode_probe  each kernel of a decode forward, timed (bench/decode_probe.py; PROBE_MODELS, PROBE_MS)
#   tma_probe     the forward with the weight tiles loaded by address and by TMA, in either GEMM or both, alternately
#             (bench/tma_probe.py; TMA_ARGS, e.g. --models mixtral-8x7b --ms 4096, or on a new GPU
#             "--gemms --install --rounds 3 --ms 256 1024 4096 16384": each GEMM's faster load into its files, which
#             come back in tma_probe/configs; --gemms --tile NAME=JSON ...: named tiles against the config in use)
#   device_probe  each point's entry in use against the one FROM_DEVICE's files give (default NVIDIA_H200; a new
#             GPU's files seeded from a tuned one's): the bf16/FP8 grid by its GEMMs, largest M first, then MX
#             (DEVICE_MX_SCHEMES, default mxfp4) by the forward; the faster past the margin goes into this GPU's
#             files (they come back in device_probe/configs). DEVICE_SECONDS / DEVICE_MX_SECONDS cap the two halves
#   sorted_gemm2  GEMM2 reading a sorted-order intermediate by TMA, persistent / warp-specialised, against today's
#             (bench/sorted_gemm2_probe.py; SORTED_POINTS, model:scheme:M; SORTED_VARIANTS, a regex of variant names;
#             SORTED_ARGS adds options, e.g. --warp-specialized, whose first launch never returned on the H100)
#   pdl_probe     the forward with dependent launches and our top-k sum on and off, alternately (bench/pdl_probe.py;
#             PDL_POINTS, model:scheme:M)
# Session 23 on the H100: `tune harness tests bench` (OUT_NAME=final), then `tests harness tune recheck`
# (OUT_NAME=onedot, after GEMM1's one-MMA tile). Every step is time-capped so the call returns what finished.
# Needs carry/whl and carry/vllm033 (bench/get_vllm_triton.sh).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site carry/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
out=${OUT:-bench/results}/${OUT_NAME:-final}
mkdir -p "$out"

without_ptx() {  # of each dump Triton prints when ptxas fails (the whole PTX, between two rules), only ptxas's lines
  awk -v rule="$(printf '=%.0s' $(seq 64))" '$0 == rule {dump = !dump; next} dump && !/^ptxas/ {next}
    /^please share the reproducer/ || !NF {next} {print}'
}
tune_one() {  # tune_one SECONDS MODEL [bench/moe.py arguments]
  local secs=$1 model=$2; shift 2
  timeout "$secs" python3 bench/moe.py --phase tune --install-configs --peer-configs carry/vllm033 \
    --out "$out/tune/$model" --models "$model" "$@" 2>&1 | grep -v "^  skip" | without_ptx >> "$out/tune.log"
}
tune() {  # TUNE_POINTS, model:scheme:M (default the weakest side-by-side points of the last run), TUNE_SECONDS per point
  local point model scheme m
  for point in ${TUNE_POINTS:-qwen3-30b-a3b:fp8_tensor:4096 deepseek-v3:fp8_tensor:4096 mixtral-8x7b:fp8_tensor:16384}; do
    IFS=: read -r model scheme m <<< "$point"
    # The sweep ends TUNE_MARGIN s (start-up, confirmation) before the cap, so the point is kept, not killed.
    # shellcheck disable=SC2086
    tune_one "${TUNE_SECONDS:-60}" "$model" --schemes "$scheme" --ms "$m" \
      --point-seconds $(( ${TUNE_SECONDS:-60} - ${TUNE_MARGIN:-30} )) ${TUNE_ARGS:-}
  done
}
decode() {
  tune_one 35 mixtral-8x7b --schemes bf16 fp8_tensor --ms 1
  tune_one 80 qwen3-30b-a3b --schemes bf16 fp8_tensor --ms 1 4 16  # M=4: the chained launch's point (s39)
  tune_one 100 deepseek-v3 --schemes bf16 fp8_tensor fp8_block --ms 1 16
  tune_one 100 gpt-oss-120b --schemes bf16 fp8_tensor mxfp4 --ms 1 16
}
tune_all() {
  local m
  for m in ${TUNE_MODELS:-mixtral-8x7b qwen3-30b-a3b deepseek-v3 gpt-oss-120b}; do
    tune_one "${TUNE_SECONDS:-140}" "$m" --schemes ${TUNE_SCHEMES:-bf16 fp8_tensor fp8_block mxfp4} \
      --ms ${TUNE_MS:-1 16 64 256 1024 4096 16384} ${TUNE_ARGS:-}
  done
}
harness() {
  timeout "${HARNESS_SECONDS:-175}" python3 bench/vllm_triton.py --vllm-dir carry/vllm033 --out "$out/vllm_triton" \
    ${HARNESS_ARGS:-} > "$out/vllm_triton.log" 2>&1
}
recheck() {
  timeout 60 python3 bench/vllm_triton.py --vllm-dir carry/vllm033 --models mixtral-8x7b \
    --out "$out/vllm_triton_recheck" > "$out/vllm_triton_recheck.log" 2>&1
}
tune_mx() {
  local m
  for m in ${TUNE_MX_MODELS:-gpt-oss-120b gpt-oss-20b}; do
    tune_one "${TUNE_SECONDS:-140}" "$m" --schemes ${TUNE_MX_SCHEMES:-mxfp4} --ms ${TUNE_MS:-16 64 256} ${TUNE_ARGS:-}
  done
}
tk() {
  local name=tk${TK_NAME:-}
  timeout "${TK_SECONDS:-240}" python3 bench/tk_mxfp4.py --tk-dir carry/triton_kernels --rounds 2 --out "$out/$name" \
    ${TK_ARGS:-} > "$out/$name.log" 2>&1
}
profile_mx() {
  local sections="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats"
  # shellcheck disable=SC2086
  timeout "${PROFILE_SECONDS:-200}" ncu --clock-control none --profile-from-start off -k "regex:gemm|matmul" \
    $sections --section SchedulerStats --section MemoryWorkloadAnalysis python3 bench/tk_mxfp4.py --profile \
    --tk-dir carry/triton_kernels --models ${PROFILE_MODELS:-gpt-oss-120b} --ms ${PROFILE_MS:-256} \
    --out "$out/profile" > "$out/ncu_mx.log" 2>&1
}
profile_vllm() {
  local sections="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats"
  sections="$sections --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis"
  local point model scheme m
  for point in ${PROFILE_POINTS:-mixtral-8x7b:fp8_tensor:1024 deepseek-v3:fp8_block:4096 qwen3-30b-a3b:fp8_tensor:4096}; do
    IFS=: read -r model scheme m <<< "$point"
    # shellcheck disable=SC2086
    timeout "${PROFILE_SECONDS:-150}" ncu --clock-control none --profile-from-start off -k "regex:kernel" $sections \
      python3 bench/vllm_triton.py --profile --vllm-dir carry/vllm033 --models "$model" --schemes "$scheme" --ms "$m" \
      --out "$out/profile_vllm/$model-$scheme-$m" > "$out/ncu_vllm_$model-$scheme-$m.log" 2>&1
  done
}
tests_mx() {
  timeout "${TESTS_SECONDS:-120}" python3 -m pytest tests/kernels/test_mx.py tests/kernels/test_e2m1_ptx.py \
    tests/kernels/test_fp4_fragments.py tests/kernels/test_fused_moe.py tests/kernels/test_decision_walk.py -k "mx or e2m1 or fragment" -q -n 8 --tb=line \
    -p no:benchmark -p no:cacheprovider 2>&1 | tail -40 > "$out/pytest.log"
}
base_then_new() {  # base_then_new DIR SECONDS SCRIPT ARGS...: carry/base's bench/SCRIPT, then this tree's (with NEW_ARGS)
  local dir=$1 secs=$2 script=$3
  shift 3
  mkdir -p "$dir"
  PYTHONPATH=/tmp/site:$PWD/carry/base timeout "$secs" python3 "carry/base/bench/$script" "$@" --out "$dir/base" \
    > "$dir/base.log" 2>&1
  # shellcheck disable=SC2086
  timeout "$secs" python3 "bench/$script" "$@" ${NEW_ARGS:-} --out "$dir/new" > "$dir/new.log" 2>&1
}
compare() {
  local dir=$out/${COMPARE_NAME:-compare}
  # shellcheck disable=SC2086
  NEW_ARGS="--baseline $dir/base/results.json" base_then_new "$dir" "${COMPARE_SECONDS:-100}" moe.py --phase bench \
    --models ${COMPARE_MODELS:-gpt-oss-120b gpt-oss-20b} --schemes ${COMPARE_SCHEMES:-mxfp4} --ms ${COMPARE_MS:-16 256 4096}
}
compare_gemms() {
  # shellcheck disable=SC2086
  base_then_new "$out/${COMPARE_NAME:-compare_gemms}" "${COMPARE_SECONDS:-150}" vllm_triton.py --per-gemm --rounds 2 \
    --vllm-dir carry/vllm033 --models ${COMPARE_MODELS:-mixtral-8x7b qwen3-30b-a3b} \
    --schemes ${COMPARE_SCHEMES:-bf16 fp8_tensor} --ms ${COMPARE_MS:-1024 4096}
}
gemv_probe() {
  timeout "${PROBE_SECONDS:-150}" python3 bench/fp4_gemv_probe.py --out "$out" > "$out/gemv_probe.log" 2>&1
}
tests_tiles() {  # the tile-variant tests alone (every cell with swapped and one-row tiles, LoRA, edge shapes)
  timeout 80 python3 -m pytest tests/kernels/test_fused_moe.py tests/kernels/test_lora.py \
    -k "variants or one_row or edge" -q -n 8 -p no:benchmark -p no:cacheprovider 2>&1 | tail -15 > "$out/pytest.log"
}
tests() {
  timeout "${TESTS_SECONDS:-110}" python3 -m pytest tests/kernels -q -n 8 -p no:benchmark -p no:cacheprovider 2>&1 | tail -15 > "$out/pytest.log"
}
bench() {
  timeout 70 python3 bench/moe.py --phase bench --models qwen3-30b-a3b --schemes bf16 fp8_tensor --ms 1 16 256 \
    --fast --baseline bench/results/quant/new/results.json --out "$out/bench" > "$out/bench.log" 2>&1
}
decode_probe() {
  timeout "${PROBE_SECONDS:-150}" python3 bench/decode_probe.py --out "$out/decode_probe" \
    --models ${PROBE_MODELS:-qwen3-30b-a3b gpt-oss-120b mixtral-8x7b deepseek-v3} --ms ${PROBE_MS:-1 16} \
    > "$out/decode_probe.log" 2>&1
}
sorted_gemm2() {
  timeout "${PROBE_SECONDS:-400}" python3 bench/sorted_gemm2_probe.py --out "$out/sorted_gemm2" \
    --points ${SORTED_POINTS:-qwen3-30b-a3b:fp8_tensor:4096 qwen3-30b-a3b:bf16:4096} --variants "${SORTED_VARIANTS:-}" \
    ${SORTED_ARGS:-} > "$out/sorted_gemm2.log" 2>&1
}
pdl_probe() {
  timeout "${PROBE_SECONDS:-150}" python3 bench/pdl_probe.py --out "$out/pdl_probe" \
    --points ${PDL_POINTS:-qwen3-30b-a3b:bf16:1 qwen3-30b-a3b:fp8_tensor:1 mixtral-8x7b:fp8_tensor:1024} \
    > "$out/pdl_probe.log" 2>&1
}
device_probe() {
  local from=h200=${FROM_DEVICE:-NVIDIA_H200} pts="" mx="" m ms s
  for m in 16384 4096 1024 256 64 16 1; do
    for ms in mixtral-8x7b:bf16 mixtral-8x7b:fp8_tensor qwen3-30b-a3b:bf16 qwen3-30b-a3b:fp8_tensor deepseek-v3:bf16 \
              deepseek-v3:fp8_tensor deepseek-v3:fp8_block gpt-oss-120b:bf16 gpt-oss-120b:fp8_tensor; do
      pts="$pts $ms:$m"
    done
  done
  for s in ${DEVICE_MX_SCHEMES:-mxfp4}; do
    for m in 1 16 64 256 1024 2048 4096; do mx="$mx gpt-oss-120b:$s:$m gpt-oss-20b:$s:$m"; done
  done
  mkdir -p "$out/device_probe"
  # shellcheck disable=SC2086
  timeout "${DEVICE_SECONDS:-300}" python3 bench/tma_probe.py --out "$out/device_probe/grid" --gemms --install \
    --rounds "${DEVICE_ROUNDS:-2}" --from-device "$from" --points $pts > "$out/device_probe_grid.log" 2>&1
  # shellcheck disable=SC2086
  timeout "${DEVICE_MX_SECONDS:-120}" python3 bench/tma_probe.py --out "$out/device_probe/mx" --install \
    --rounds "${DEVICE_ROUNDS:-2}" --from-device "$from" --points $mx > "$out/device_probe_mx.log" 2>&1
  cp -r kernels/configs "$out/device_probe/configs"
}
tma_probe() {
  # shellcheck disable=SC2086
  timeout "${PROBE_SECONDS:-400}" python3 bench/tma_probe.py --out "$out/tma_probe" ${TMA_ARGS:-} > "$out/tma_probe.log" 2>&1
  cp -r kernels/configs "$out/tma_probe/configs"
}
for step in "$@"; do "$step"; done

find "$out" -name bench.csv -delete
# A device run returns at most 8 files: the tuning (log, results, installed configs) travels as one archive.
if [ -d "$out/tune" ]; then
  cp -r kernels/configs "$out/tune/configs" && tar -czf "$out/tune.tgz" -C "$out" tune tune.log && rm -rf "$out/tune" "$out/tune.log"
  tar -xzOf "$out/tune.tgz" tune.log | grep "^tuned" | cut -c1-90
fi
tail -3 "$out/pytest.log" 2>/dev/null; tail -8 "$out"/vllm_triton*.log "$out"/tk*.log "$out"/*probe*.log 2>/dev/null
# Past 8 files, the rest travels as one archive too (the logs stay readable beside it).
if [ "$(find "$out" -type f | wc -l)" -gt 8 ]; then
  tar -czf /tmp/results.tgz -C "$out" . && mv /tmp/results.tgz "$out/" &&
    find "$out" -mindepth 1 -maxdepth 1 ! -name results.tgz ! -name '*.log' ! -name tune.tgz -exec rm -rf {} +
fi
