#!/usr/bin/env bash
# Set up, then decide + explain a real layer, and run two layers on real kernels: gpt-oss-120b on an MI355 (gfx950) with AITER.
# Its 2880-wide hidden size is not 256-aligned, so AITER's CK MXFP4 pads it to 3072 (as vLLM 0.33 does):
# the explanation shows the padding, the ranking with each rule's file:line, and every other backend's rejection.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/setup.sh
set -x
moerules decide examples/gpt-oss-120b-mi355.yaml
moerules explain examples/gpt-oss-120b-mi355.yaml
moerules run examples/mixtral-cpu.yaml
TRITON_INTERPRET=1 moerules run examples/mixtral-small-sm90.yaml --device cpu
