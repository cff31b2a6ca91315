"""Every kernel constant that carries meaning, pinned by behaviour against a value stated here independently.

Each test feeds inputs where the constant decides the output and compares with numbers written out from
their source (the gpt-oss reference SwiGLU, the e4m3fn/int8 ranges, the 128-wide DeepSeek blocks, the OCP
MX v1.0 rules, torch's GELU), never by reading the constant back, so changing one (the swiglu limit 7.0 ->
9.0, say) fails here. Triton device code runs through the interpreter on a CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from kernel_helpers import DEVICE, RecordingKernel, make_layer, random_inputs

from moerules import MoEConfig
from moerules.activation import Activation, SwigluParams
from moerules.kernels.activations import apply_activation
from moerules.kernels.mx import e8m0_decode, quantize_mx
from moerules.kernels.quantize import dequantize_activation, quantize_activation, quantize_weight
from moerules.kernels.triton.fused_moe import _activation, _gated_activation
from moerules.kernels.triton import launch
from moerules.kernels.triton.launch import ACTIVATION_CODE
from moerules.kernels.triton.quant import quantize_activation_triton
from moerules.presets import preset
from moerules.quant import Granularity as G

GPT_OSS_CONFIG = Path(__file__).parents[1] / "hf" / "configs" / "gpt-oss-120b.json"
# gpt-oss's reference SwiGLU (openai/gpt-oss, torch/model.py: swiglu(x, alpha=1.702, limit=7.0)).
GPT_OSS_LIMIT, GPT_OSS_ALPHA = 7.0, 1.702
E4M3_MAX, INT8_MAX = 448.0, 127.0   # the largest finite float8_e4m3fn (1.75 * 2^8); symmetric int8


def gpt_oss_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    gate, up = gate.double().clamp(max=GPT_OSS_LIMIT), up.double().clamp(-GPT_OSS_LIMIT, GPT_OSS_LIMIT)
    return gate * torch.sigmoid(GPT_OSS_ALPHA * gate) * (up + 1)


def _gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


# Torch's own functions: independent of the device code's constants (erf's 1/sqrt(2), tanh's sqrt(2/pi), 0.044715).
TORCH_ACT = {Activation.silu: F.silu, Activation.gelu: F.gelu, Activation.gelu_tanh: _gelu_tanh,
             Activation.silu_no_mul: F.silu, Activation.gelu_no_mul: F.gelu,
             Activation.relu2_no_mul: lambda x: F.relu(x) ** 2}
# Gate and up values on both sides of +-7 (and where alpha matters: |gate| ~ 1/alpha).
GATE = torch.tensor([-30.0, -7.5, -1.0, -0.3, 0.0, 0.6, 2.0, 6.9, 7.0, 7.2, 8.0, 50.0])
UP = torch.tensor([9.0, -9.0, 7.5, -7.2, 3.0, 6.95, -6.95, 8.0, -30.0, 0.5, 7.0, -1.0])


@triton.jit
def _activation_kernel(gate_ptr, up_ptr, out_ptr, n, limit, alpha, GATED: tl.constexpr, ACTIVATION: tl.constexpr,
                       PTX_MATH: tl.constexpr, EIGHT_BIT_OUT: tl.constexpr, BLOCK: tl.constexpr):
    """The fused GEMM1 epilogue's activation, elementwise over vectors (no GEMM around it)."""
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(gate_ptr + offs, mask=mask, other=0.0)
    if GATED:
        up = tl.load(up_ptr + offs, mask=mask, other=0.0)
        out = _gated_activation(gate, up, limit, alpha, ACTIVATION, PTX_MATH, EIGHT_BIT_OUT)
    else:
        out = _activation(gate, ACTIVATION, PTX_MATH, EIGHT_BIT_OUT)
    tl.store(out_ptr + offs, out, mask=mask)


def triton_activation(activation: Activation, gate, up, swiglu: SwigluParams = SwigluParams(), *,
                      ptx_math: bool = False, eight_bit_out: bool = False) -> torch.Tensor:
    """The device code on gate and up: in float64 (rounding far below any constant's change), or with ptx_math in
    fp32 (the sigmoid's PTX takes fp32), as the GPU GEMMs compute it (eight_bit_out: for an output quantised to 8
    bits next)."""
    dtype = torch.float32 if ptx_math else torch.float64
    gate, up = gate.to(DEVICE, dtype), up.to(DEVICE, dtype)
    out = torch.empty_like(gate)
    _activation_kernel[(1,)](gate, up, out, gate.numel(), swiglu.limit, swiglu.alpha, GATED=activation.gated,
                             ACTIVATION=ACTIVATION_CODE[activation], PTX_MATH=ptx_math,
                             EIGHT_BIT_OUT=eight_bit_out, BLOCK=triton.next_power_of_2(gate.numel()))
    return out.cpu()


def _interleave(gate, up):
    return torch.stack([gate, up], dim=-1).flatten(-2)


def _swiglu_sources():
    """The swigluoai parameters as each entry point hands them to the kernels."""
    hf = json.loads(GPT_OSS_CONFIG.read_text())
    without_limit = {k: v for k, v in hf.items() if k != "swiglu_limit"}
    return {"SwigluParams()": SwigluParams(), "preset gpt-oss-120b": MoEConfig(**preset("gpt-oss-120b")).model.swiglu,
            "from_hf gpt-oss-120b": MoEConfig.from_hf(hf).model.swiglu,
            "from_hf without swiglu_limit": MoEConfig.from_hf(without_limit).model.swiglu}


@pytest.mark.parametrize("source", list(_swiglu_sources()))
def test_swigluoai_defaults_compute_gpt_oss_swiglu(source):
    swiglu = _swiglu_sources()[source]
    expected = gpt_oss_swiglu(GATE, UP)
    torch_out = apply_activation(_interleave(GATE, UP).double(), Activation.swigluoai, swiglu)
    torch.testing.assert_close(torch_out, expected, rtol=1e-12, atol=1e-12)
    # The kernel takes limit and alpha as fp32 scalars (6e-8 relative rounding; 2.3e-8 absolute seen on the H100),
    # so 1e-6: still a thousand times under what alpha 1.702 -> 1.7 or any limit change moves.
    torch.testing.assert_close(triton_activation(Activation.swigluoai, GATE, UP, swiglu), expected, rtol=1e-6,
                               atol=1e-6)


@pytest.mark.skipif(DEVICE != "cuda", reason="the sigmoid's PTX (fused_moe._SIGMOID_PTX) compiles for CUDA only")
@pytest.mark.parametrize("activation", list(ACTIVATION_CODE))
def test_the_ptx_sigmoid_computes_torchs_activations(activation):
    """What the GPU GEMMs run: fp32 with the SFU's flushed approximations, within 2e-6 of torch in float64 (ex2 and
    rcp err by 2 and 1 ulp; fp32 itself rounds at 6e-8), with torch's fp32 NaN and infinities at the edges."""
    x = torch.cat([torch.linspace(-40, 40, 161), torch.tensor([-100.0, 100.0])])
    up = torch.linspace(-9, 9, x.numel())
    if activation in TORCH_ACT:
        expected = TORCH_ACT[activation](x.double()) * (up.double() if activation.gated else 1.0)
    else:  # the swigluoai codes
        expected = gpt_oss_swiglu(x, up)
    got = triton_activation(activation, x, up, ptx_math=True)
    torch.testing.assert_close(got.double(), expected, rtol=2e-6, atol=1e-6)
    edges = torch.tensor([float("-inf"), float("inf"), float("nan")])
    if activation in (Activation.silu, Activation.silu_no_mul, Activation.gelu_tanh):  # their sigmoid is the PTX
        expected = TORCH_ACT[activation](edges)
        torch.testing.assert_close(triton_activation(activation, edges, torch.ones(3), ptx_math=True), expected,
                                   equal_nan=True)


@pytest.mark.skipif(DEVICE != "cuda", reason="the tanh sigmoid's PTX (fused_moe._TANH_PTX) compiles for CUDA only")
@pytest.mark.parametrize("activation", list(ACTIVATION_CODE))
def test_the_tanh_sigmoid_is_within_its_bound_of_torchs_activations(activation):
    """For outputs quantised to 8 bits next (EIGHT_BIT_OUT): sigmoid = 0.5 + 0.5 tanh(x / 2) from tanh.approx.f32
    (max relative error 2^-10.99), so the sigmoid errs by at most 2.5e-4 and an activation by that times what
    multiplies it (|x| for silu, |x * up| gated; relu^2 and erf-gelu have no sigmoid and stay at 2e-6). Far inside
    the e4m3 rounding that follows (2^-4 relative), and the edges stay torch's."""
    x = torch.cat([torch.linspace(-40, 40, 1601), torch.tensor([-100.0, 100.0])])
    up = torch.linspace(-9, 9, x.numel())
    if activation in TORCH_ACT:
        expected = TORCH_ACT[activation](x.double()) * (up.double() if activation.gated else 1.0)
        factor = x.double().abs() * (up.double().abs() if activation.gated else 1.0)
    else:  # the swigluoai codes: gate clamped to 7, up to +-7 and shifted by one
        expected = gpt_oss_swiglu(x, up)
        factor = x.double().clamp(max=7.0).abs() * (up.double().clamp(-7.0, 7.0) + 1.0).abs()
    got = triton_activation(activation, x, up, ptx_math=True, eight_bit_out=True).double()
    uses_sigmoid = activation not in (Activation.relu2_no_mul, Activation.gelu, Activation.gelu_no_mul)
    bound = (2.5e-4 * factor if uses_sigmoid else 0.0) + 2e-6 * expected.abs() + 1e-6
    worst = ((got - expected).abs() / bound).max().item()
    assert worst <= 1.0, f"{worst:.2f} x the bound"
    edges = torch.tensor([float("-inf"), float("inf"), float("nan")])
    if activation in (Activation.silu, Activation.silu_no_mul, Activation.gelu_tanh):
        torch.testing.assert_close(triton_activation(activation, edges, torch.ones(3), ptx_math=True,
                                                     eight_bit_out=True), TORCH_ACT[activation](edges), equal_nan=True)


@pytest.mark.parametrize("cell, eight_bit", [("fp8_w8a8/tensor/tensor", True), ("fp8_w8a8/channel/token", True),
                                             ("int8_w8a8/channel/token", True), ("fp8_w8a16/channel", False),
                                             ("unquantized", False)])
def test_the_tanh_sigmoid_serves_only_intermediates_quantised_to_8_bits(cell, eight_bit, monkeypatch):
    """launch.gemm1 asks for the coarse sigmoid (EIGHT_BIT_OUT) exactly where GEMM2 quantises its input."""
    recording = RecordingKernel(launch.gemm1_gated_kernel)
    monkeypatch.setattr(launch, "gemm1_gated_kernel", recording)
    layer = make_layer("triton.fused_moe", cell, E=4, H=64, I=64, device=DEVICE)
    x, ids, w = random_inputs(layer, 5, 2, device=DEVICE)
    layer(x, topk_ids=ids, topk_weights=w)
    assert [k["EIGHT_BIT_OUT"] for k in recording.launches] == [eight_bit]


@pytest.mark.parametrize("activation", [a for a in ACTIVATION_CODE if a in TORCH_ACT])
def test_triton_activations_are_torchs(activation):
    x = torch.linspace(-6, 6, 97)
    up = torch.linspace(2, -1, 97)
    expected = TORCH_ACT[activation](x.double())
    if activation.gated:
        expected = expected * up.double()
    torch.testing.assert_close(triton_activation(activation, x, up), expected, rtol=1e-12, atol=1e-12)


QUANTIZERS = {"torch": quantize_activation, "triton": quantize_activation_triton}


@pytest.mark.parametrize("dtype,qmax", [(torch.float8_e4m3fn, E4M3_MAX), (torch.int8, INT8_MAX)])
@pytest.mark.parametrize("gran", [G.tensor, G.token, G.group128])
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_dynamic_scales_map_the_amax_to_the_dtype_maximum(impl, gran, dtype, qmax):
    """amax / scale is the dtype's largest value: 448 for e4m3fn, 127 for int8 (each group, row or tensor)."""
    x = torch.zeros(3, 256)
    x[0, 5], x[1, 200], x[2, 0], x[2, 130] = 896.0, -3.5, 1.0, 0.25   # exact multiples of their scales
    q, scale = QUANTIZERS[impl](x.to(DEVICE), dtype=dtype, granularity=gran)
    q, scale = q.cpu().float(), scale.cpu().double()
    assert q[0, 5].item() == qmax and (gran == G.tensor or q[1, 200].item() == -qmax)
    amax = {G.tensor: torch.tensor([896.0]), G.token: torch.tensor([896.0, 3.5, 1.0]),
            G.group128: torch.tensor([[896.0, 0.0], [0.0, 3.5], [1.0, 0.25]])}[gran]
    expected = (amax.double() / qmax)
    torch.testing.assert_close(scale.where(amax > 0, 0.0), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_activation_groups_are_128_wide(impl):
    """Column 127 is the last of group 0, column 128 the first of group 1 (DeepSeek's 1x128 activation blocks)."""
    x = torch.ones(2, 384)
    x[0, 127], x[1, 128] = 44.8, 44.8
    _, scale = QUANTIZERS[impl](x.to(DEVICE), dtype=torch.float8_e4m3fn, granularity=G.group128)
    expected = torch.tensor([[0.1, 1 / E4M3_MAX, 1 / E4M3_MAX], [1 / E4M3_MAX, 0.1, 1 / E4M3_MAX]])
    torch.testing.assert_close(scale.cpu(), expected.float(), rtol=1e-6, atol=0)


def test_weight_blocks_are_128_by_128():
    w = torch.ones(1, 256, 384)
    w[0, 127, 255], w[0, 128, 256] = 44.8, 89.6
    _, scale = quantize_weight(w, dtype=torch.float8_e4m3fn, granularity=G.block128)
    expected = torch.full((1, 2, 3), 1 / E4M3_MAX)
    expected[0, 0, 1], expected[0, 1, 2] = 0.1, 0.2
    torch.testing.assert_close(scale, expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_mx_groups_are_32_wide_with_e8m0_bias_127_and_e4m3_emax_8(impl):
    """OCP MX v1.0: X = floor(log2 amax) - 8 for e4m3 elements, stored as X + 127; groups of 32 along K."""
    x = torch.full((1, 96), 2.0 ** -20)
    x[0, 31], x[0, 32], x[0, 95] = 448.0, 1.0, 2.0 ** 20      # groups 0, 1, 2 (column 31 ends group 0)
    q, scale = QUANTIZERS[impl](x.to(DEVICE), dtype=torch.float8_e4m3fn, granularity=G.group32)
    assert scale.cpu().tolist() == [[127, 119, 139]]   # 2^0, 2^-8, 2^12
    assert e8m0_decode(torch.tensor([127, 119, 139])).tolist() == [1.0, 2.0 ** -8, 2.0 ** 12]
    back = dequantize_activation(q.cpu(), scale.cpu(), granularity=G.group32)
    assert back[0, [31, 32, 95]].tolist() == [448.0, 1.0, 2.0 ** 20]


def test_mxfp4_e8m0_uses_e2m1_emax_2():
    """e2m1 elements: X = floor(log2 amax) - 2 (6 = 1.5 * 2^2 is the largest element)."""
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 32] = 6.0, 1.0
    _, scale = quantize_mx(x, fp4=True)
    assert scale.tolist() == [[127, 125]]


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_a_huge_finite_value_sets_the_per_tensor_scale(impl):
    """The NaN policy leaves out only NaN and Inf: fp32's largest finite value is a value (scale = it / 448)."""
    x = torch.tensor([[3.4028234663852886e38, 1.0, -2.0, 0.0]])
    q, scale = QUANTIZERS[impl](x.to(DEVICE), dtype=torch.float8_e4m3fn, granularity=G.tensor)
    assert scale.cpu().item() == pytest.approx(3.4028234663852886e38 / E4M3_MAX, rel=1e-6)
    assert q.cpu().float()[0, 0].item() == E4M3_MAX
