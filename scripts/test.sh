#!/usr/bin/env bash
# Set up, then run everything CI runs: the test suite, the rule linter and the schema freshness check.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/setup.sh
set -x
moerules schema --check
moerules lint
python -m pytest -q "$@"
