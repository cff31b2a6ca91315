#!/usr/bin/env bash
# Set up, then run everything CI runs: schema freshness, rule lint, the rule cases, static import resolution
# (mypy), the golden decision matrix, a sample of rule mutants, conformance with vLLM 0.33 on a sample, and the test suite.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/setup.sh
echo "moerules: installing vLLM 0.33.0's selection code for the conformance check (--no-deps: its compiled"\
     "extensions are never loaded) and the light packages its oracle imports"
pip install --quiet --disable-pip-version-check --no-deps "vllm==0.33.0"
pip install --quiet --disable-pip-version-check -e ".[vllm]" -c constraints.txt
echo "moerules: installing transformers and safetensors for the Hugging Face round-trip tests (tests/hf)"
pip install --quiet --disable-pip-version-check -e ".[hf]" -c constraints.txt
echo "moerules: installing playwright and Debian's Chromium for the matrix page's browser test"
pip install --quiet --disable-pip-version-check -e ".[browser]" -c constraints.txt
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1 ||
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }
fi
# Where Chromium is here (CI runs as root), the browser test must run, never skip.
if [ -x /usr/bin/chromium ]; then export MOERULES_REQUIRE_BROWSER=1; fi
set -x
moerules schema --check
moerules lint
moerules test --min-coverage 100   # the cases beside each rule file; every rule is defended by one
bash scripts/typecheck.sh python --package   # mypy resolves every moerules module (editable install)
moerules matrix --check
moerules matrix --check --engine reference   # the engine differential over every cell
# A different sample of rule mutants each commit (seeded by the commit, printed, reproducible).
seed=$(( 16#$(git rev-parse --short=6 HEAD 2>/dev/null || echo 0) ))
moerules mutate --sample 8 --seed "$seed"
moerules conformance --check --sample 3000   # vs the committed reports/conformance.csv
python -m pytest -q "$@"
