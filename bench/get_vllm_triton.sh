#!/usr/bin/env bash
# Puts vLLM 0.33.0's fused_moe.py and its tuned configs/ into carry/vllm033 (ignored, never committed), the
# --vllm-dir of bench/vllm_triton.py on a machine without vllm (carry it to the GPU machine with carry/whl).
# Source: the installed vllm package when it is 0.33.0 (located from its metadata, not imported), else the
# wheel: $WHEEL if set, else `pip download vllm==0.33.0 --no-deps` into a temporary folder (~340 MB).
#   bash bench/get_vllm_triton.sh            # PYTHON=... to pick the interpreter (default python3)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python=${PYTHON:-python3}
dest=carry/vllm033
rel=vllm/model_executor/layers/fused_moe
installed=$("$python" - <<'PY'
import importlib.metadata, importlib.util, pathlib
try:
    version = importlib.metadata.version("vllm")
except importlib.metadata.PackageNotFoundError:
    version = None
spec = importlib.util.find_spec("vllm")
print(pathlib.Path(spec.origin).parent.parent if version == "0.33.0" and spec and spec.origin else "")
PY
)
rm -rf "$dest"
mkdir -p "$dest"
if [ -n "$installed" ]; then
  cp "$installed/$rel/fused_moe.py" "$dest/"
  cp -r "$installed/$rel/configs" "$dest/"
  echo "installed vllm 0.33.0 at $installed" > "$dest/SOURCE"
else
  wheel=${WHEEL:-}
  if [ -z "$wheel" ]; then
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    "$python" -m pip download --quiet --no-deps --only-binary=:all: -d "$tmp" "vllm==0.33.0"
    wheel=$(ls "$tmp"/vllm-0.33.0-*.whl)
  fi
  "$python" - "$wheel" "$rel" "$dest" <<'PY'
import pathlib, sys, zipfile
wheel, rel, dest = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3])
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name == f"{rel}/fused_moe.py" or (name.startswith(f"{rel}/configs/") and not name.endswith("/")):
            target = dest / name[len(rel) + 1:]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(z.read(name))
PY
  echo "wheel $(basename "$wheel")" > "$dest/SOURCE"
fi
test -f "$dest/fused_moe.py" || { echo "get_vllm_triton.sh: no $rel/fused_moe.py in the source" >&2; exit 1; }
echo "$dest: fused_moe.py ($(sha256sum "$dest/fused_moe.py" | cut -c1-16)) and $(ls "$dest/configs" | wc -l) config files from $(cat "$dest/SOURCE")"
