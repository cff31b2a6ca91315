#!/usr/bin/env bash
# Puts OpenAI's triton_kernels package, unmodified, into carry/triton_kernels/triton_kernels (ignored, never
# committed): the --tk-dir of bench/tk_mxfp4.py (carry it to the GPU machine with carry/triton_kernels).
# Source: a wheel that bundles the package at its root (default: sglang_kernel 0.4.5, whose triton_kernels has
# the matmul_ogs + SparseMatrix API that vLLM 0.33 calls "3.6"), or a folder holding triton_kernels/ or the
# package folder itself.
#   bash bench/get_triton_kernels.sh [WHEEL_OR_FOLDER]      # PYTHON=... to pick the interpreter (default python3)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python=${PYTHON:-python3}
src=${1:-/work/dl-external/sglang_kernel-0.4.5-cp310-abi3-manylinux2014_x86_64.whl}
dest=carry/triton_kernels
if [ ! -e "$src" ]; then
  cat >&2 <<EOF
get_triton_kernels.sh: no $src.
Pass a wheel that bundles triton_kernels (sglang_kernel 0.4.5:
  $python -m pip download --no-deps --only-binary=:all: -d /tmp/sgl sglang-kernel==0.4.5
  bash bench/get_triton_kernels.sh /tmp/sgl/sglang_kernel-0.4.5-*.whl)
or a folder holding triton_kernels/ (or the package folder itself).
EOF
  exit 1
fi
rm -rf "$dest"
mkdir -p "$dest"
if [ -d "$src" ]; then
  # The package folder itself, or a folder holding it.
  pkg=$src
  [ -f "$pkg/matmul_ogs.py" ] || pkg=$src/triton_kernels
  [ -f "$pkg/matmul_ogs.py" ] || { echo "get_triton_kernels.sh: no triton_kernels/matmul_ogs.py in $src" >&2; exit 1; }
  cp -r "$pkg" "$dest/triton_kernels"
  find "$dest" -name __pycache__ -type d -prune -exec rm -rf {} +
  echo "folder $(cd "$pkg" && pwd)" > "$dest/SOURCE"
else
  "$python" - "$src" "$dest" <<'PY'
import pathlib, sys, zipfile
wheel, dest = sys.argv[1], pathlib.Path(sys.argv[2])
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith("triton_kernels/") and not n.endswith("/")]
    if "triton_kernels/matmul_ogs.py" not in names:
        sys.exit(f"get_triton_kernels.sh: {wheel} has no triton_kernels/matmul_ogs.py at its root")
    for name in names:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(z.read(name))
PY
  echo "wheel $(basename "$src")" > "$dest/SOURCE"
fi
# One digest over every file (path and content), so a run's results.json names exactly the code it ran.
digest=$(cd "$dest" && find triton_kernels -type f | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16)
echo "sha256-of-files $digest" >> "$dest/SOURCE"
files=$(find "$dest/triton_kernels" -name '*.py' | wc -l)
echo "$dest/triton_kernels: $files Python files from $(head -1 "$dest/SOURCE") ($digest)"
