#!/usr/bin/env bash
# External kernels on the GPU, in one device run (bench/results/external/README.md says how it is carried):
#   the adapter tests (numerics at gpt-oss shapes, the Hopper swizzle round trip), the decision walk's
#   oai_triton layers, and the regret benchmark. Writes under $OUT/external. Arguments go to bench/regret.py.
set -uo pipefail
# pydantic & co.: unpacked in $EXTRA_SITE, or installed here from the wheels in carry/whl.
site=${EXTRA_SITE:-/tmp/site}
[ -n "${EXTRA_SITE:-}" ] || python3 -m pip install -q --no-index --no-deps --target "$site" carry/whl/*.whl
export PYTHONPATH=$site:${EXTERNAL_PKGS:-$PWD/external_pkgs}:$PWD PYTHONUNBUFFERED=1
out=${OUT:-bench/results}/external; mkdir -p "$out"
nvidia-smi -L | tee "$out/device.txt"
python3 -c "import triton, triton_kernels, torch; print('triton', triton.__version__, 'torch', torch.__version__)" \
  | tee -a "$out/device.txt"
timeout 240 python3 -m pytest tests/kernels/test_external_adapters.py -q -p no:cacheprovider 2>&1 | tail -40 \
  | tee "$out/log_pytest_external.txt"
timeout 240 python3 -m pytest tests/kernels/test_decision_walk.py -q -p no:cacheprovider -k "oai_triton or external" \
  2>&1 | tail -25 | tee "$out/log_walk_external.txt"
timeout 420 python3 bench/regret.py --out "$out" "$@" 2>&1 | tee "$out/log_regret.txt"
