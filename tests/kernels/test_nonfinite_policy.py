"""The numerical policy for non-finite and extreme inputs (README, "Non-finite inputs"), per scheme cell:
a token holding NaN or Inf damages its own output row only, and a huge finite token leaves every output
finite. Before the policy, dynamic per-tensor FP8 scales took their amax over NaN/Inf too, and one bad
token turned every token's output into NaN.

The bad tokens' own rows are not checked (they are the damage). The other rows are compared with the
same layer run on the good tokens alone, within the tolerances of test_fused_moe.py (a 1-ulp difference
in the fp16 intermediate can flip one fp8/int8 rounding): every scale they see is the one the good
tokens alone give, per-tensor ones included, since a non-finite element is left out of the amax and
quantises to NaN.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from kernel_helpers import DEVICE, TRITON_DTYPE, make_layer, random_inputs

from moerules.activation import Activation, Dtype
from moerules.kernels import build_layer, make_random_weights

from moerules.kernels.quantize import finite_amax
from moerules.kernels.registry import EXPERTS
from moerules.kernels.scheme import quant_for_cell as quant_of
from moerules.kernels.triton.quant import quantize_activation_triton
from moerules.quant import Granularity

# NaN in the Triton interpreter's numpy arithmetic raises RuntimeWarnings, which are the point here.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

BAD = {2: float("nan"), 5: float("inf"), 7: float("-inf")}   # whole rows
HUGE = 6e4   # near fp16's largest finite value: its GEMM1 output overflows fp16 to Inf
M = 10
INTERPRETED = not torch.cuda.is_available()
ONE_ROW = 4
OTHERS = [r for r in range(M) if r != ONE_ROW]


def _tolerance(layer, cell: str) -> Optional[float]:
    if INTERPRETED and layer.kernel_id.startswith("triton") and cell.endswith("/tensor"):
        # The interpreter decodes the fp8 NaN byte as 480, so the NaN rows enter GEMM1 finite and their
        # intermediate joins the per-tensor amax: the other rows stay finite (checked) but move by fp8
        # noise, so the comparison runs on a GPU only.
        return None
    return 1e-2 if "w8a8" in cell or "mxfp8" in cell else 2e-3


def _check_policy(layer, cell: str) -> None:
    x, ids, w = random_inputs(layer, M, 2, device=DEVICE)
    good = [r for r in range(M) if r not in BAD]
    bad_x, zeroed = x.clone(), x.clone()
    for row, value in BAD.items():
        bad_x[row], zeroed[row] = value, 0.0
    out = layer(bad_x, topk_ids=ids, topk_weights=w)[good]
    assert torch.isfinite(out).all(), f"a bad token poisoned rows {(~torch.isfinite(out).all(1)).nonzero().tolist()}"
    # Zero rows add nothing to any amax, as the non-finite rows must not: the good rows then see equal scales.
    tolerance = _tolerance(layer, cell)
    if tolerance is not None:
        clean = layer(zeroed, topk_ids=ids, topk_weights=w)[good]
        err = ((out.double() - clean.double()).norm() / clean.double().norm()).item()
        assert err < tolerance, err
    for value in (float("nan"), float("inf"), HUGE):   # one element of one row
        one = x.clone()
        one[ONE_ROW, 3] = value
        assert torch.isfinite(layer(one, topk_ids=ids, topk_weights=w)[OTHERS]).all(), value


@pytest.mark.parametrize("cell", sorted(EXPERTS["torch.reference"].cells))
def test_reference_keeps_a_bad_tokens_damage_in_its_row(cell):
    _check_policy(make_layer("torch.reference", cell, dtype=Dtype.fp16, H=128, I=64, device=DEVICE), cell)


@pytest.mark.parametrize("cell", sorted(EXPERTS["triton.fused_moe"].cells))
def test_triton_keeps_a_bad_tokens_damage_in_its_row(cell):
    _check_policy(make_layer("triton.fused_moe", cell, dtype=TRITON_DTYPE, H=128, I=64, device=DEVICE), cell)


@pytest.mark.parametrize("kernel_id", ["triton.batched_moe", "torch.batched_reference"])
@pytest.mark.parametrize("cell", ["fp8_w8a8/tensor/tensor", "fp8_w8a8/channel/token", "unquantized"])
def test_batched_experts_keep_a_bad_tokens_damage_in_its_row(kernel_id, cell):
    dtype = TRITON_DTYPE if kernel_id.startswith("triton") else Dtype.fp16
    w = make_random_weights(num_experts=8, hidden=128, intermediate=64, quant=quant_of(cell), in_dtype=dtype,
                            has_bias=False, seed=0, device=DEVICE)
    layer = build_layer(kernel_id=kernel_id, prepare_finalize_id="local_batched", quant=quant_of(cell),
                        activation=Activation.silu, in_dtype=dtype, activation_format="batched", weights=w,
                        device=DEVICE, defer_input_quant=True)
    _check_policy(layer, cell)


def test_the_per_tensor_amax_leaves_non_finite_values_out():
    x = torch.tensor([[1.0, -3.0, float("nan")], [float("inf"), float("-inf"), 2.0]])
    assert finite_amax(x).item() == 3.0
    assert finite_amax(torch.full((2, 2), float("nan"))).item() == 0.0
    assert finite_amax(torch.empty(0, 4)).item() == 0.0


@pytest.mark.skipif(INTERPRETED, reason="the interpreter converts fp32 NaN to a finite fp8 byte")
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("rows", [6, 1000])  # one program; the grid-stride partial amax and quantise passes
def test_the_triton_per_tensor_quantiser_maps_non_finite_values_to_nan(static, rows):
    """The CUDA path (quantize_activation_triton): NaN exactly where x is not finite, and a dynamic scale
    from the finite values only."""
    x = torch.randn(rows, 40, device=DEVICE)
    x[1, 3], x[4, 0], x[-1, 9] = float("nan"), float("inf"), float("-inf")
    static_scale = torch.tensor([0.01], device=DEVICE) if static else None
    q, scale = quantize_activation_triton(x, dtype=torch.float8_e4m3fn, granularity=Granularity.tensor,
                                          static_scale=static_scale)
    assert torch.equal(torch.isnan(q.float()), ~torch.isfinite(x))
    expected = 0.01 if static else finite_amax(x).item() / 448.0
    assert scale.item() == pytest.approx(expected, rel=1e-6)
