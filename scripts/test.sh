#!/usr/bin/env bash
# Set up, then run everything CI runs: schema freshness, rule lint, the golden decision matrix,
# a sample of rule mutants, and the test suite.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/setup.sh
set -x
moerules schema --check
moerules lint
moerules matrix --check
moerules matrix --check --engine reference   # the engine differential over every cell
# A different sample of rule mutants each commit (seeded by the commit, printed, reproducible).
seed=$(( 16#$(git rev-parse --short=6 HEAD 2>/dev/null || echo 0) ))
moerules mutate --sample 8 --seed "$seed"
python -m pytest -q "$@"
