#!/usr/bin/env bash
# Static tools must see every moerules module where it is installed (an editable checkout or the wheel):
# mypy over a user's file outside the repo that imports the engine, the kernels and the tools, and, given
# --package, over the whole package with the repo's mypy settings. Gated: a module mypy cannot find, and
# a public name it types as Any. The package's other type errors are not gated yet.
# Usage: scripts/typecheck.sh PYTHON [--package]
set -euo pipefail
python=$1
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
user=$(mktemp -d)
trap 'rm -rf "$user"' EXIT
cat > "$user/uses_moerules.py" <<'PY'
from moerules.engine.decide import decide
from moerules.kernels.registry import EXPERTS
from moerules.tools.cli.main import main

reveal_type(decide)
reveal_type(EXPERTS)
reveal_type(main)
PY
rc=0
(cd "$user" && "$python" -m mypy --no-error-summary --no-incremental uses_moerules.py > mypy.txt) || rc=$?
[ "$rc" -le 1 ] || { cat "$user/mypy.txt"; echo "typecheck: mypy failed to run (exit $rc)"; exit 2; }
if grep -E '\[import-(not-found|untyped)\]|Revealed type is "Any"' "$user/mypy.txt"; then
  echo "typecheck: mypy cannot resolve moerules from a user's project (above)"; exit 1
fi
[ "$(grep -c 'Revealed type is' "$user/mypy.txt")" = 3 ] || { cat "$user/mypy.txt"; exit 1; }
echo "typecheck: a user's project resolves moerules.engine, .kernels and .tools ($(grep -o 'def (.*' "$user/mypy.txt" | head -1 | cut -c1-60)...)"
if [ "${2:-}" = --package ]; then
  rc=0
  (cd "$repo" && "$python" -m mypy --no-error-summary -p moerules > "$user/package.txt") || rc=$?
  [ "$rc" -le 1 ] || { cat "$user/package.txt"; echo "typecheck: mypy failed to run (exit $rc)"; exit 2; }
  if grep -E '\[import-(not-found|untyped)\]' "$user/package.txt"; then
    echo "typecheck: mypy -p moerules cannot find the modules above"; exit 1
  fi
  echo "typecheck: mypy -p moerules: 0 import errors ($(grep -c ': error:' "$user/package.txt" || true) type errors, not gated)"
fi
