#!/usr/bin/env bash
# Create .venv (if needed) and install moerules editable with the kernel and test extras.
# Source it: `. scripts/setup.sh` leaves the venv active.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "moerules: creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
echo "moerules: installing (editable, with torch/triton for the kernels and pytest/hypothesis)"
pip install --quiet --disable-pip-version-check -e ".[test]" -c constraints.txt
