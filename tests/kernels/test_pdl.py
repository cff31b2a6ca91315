"""Programmatic dependent launch (kernels/triton/pdl.py): a kernel launched before the one ahead of it has finished
must not touch memory until that one has, so every kernel taking PDL starts by waiting for it."""

from __future__ import annotations

import ast
import inspect

import pytest
import torch

from moerules.kernels.triton import align, chain, fused_moe, pdl, quant, topk_sum


def _functions_taking_pdl():
    for module in (align, chain, fused_moe, quant, topk_sum):
        tree = ast.parse(inspect.getsource(module))
        for fn in tree.body:
            if isinstance(fn, ast.FunctionDef) and "PDL" in [a.arg for a in fn.args.args]:
                yield f"{module.__name__}.{fn.name}", fn


TAKING_PDL = dict(_functions_taking_pdl())
KERNELS = {name: fn for name, fn in TAKING_PDL.items() if name.endswith("_kernel")}
GEMM_TILES = {name: fn for name, fn in TAKING_PDL.items() if name.endswith("_tile")}


def _body(fn: ast.FunctionDef) -> list:
    body = fn.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):  # the docstring
        body = body[1:]
    return body


def test_the_forward_kernels_launch_dependently():
    assert {name.rsplit(".", 1)[1] for name in KERNELS} == {
        "_count_kernel", "_run_offsets_kernel", "_one_program_align_kernel", "_block_experts_kernel",
        "_scatter_kernel", "gemm1_gated_kernel", "gemm2_weighted_kernel", "chained_moe_kernel",
        "_tensor_amax_kernel", "_tensor_quant_kernel", "_token_quant_kernel", "_mx_dequant_kernel",
        "_group_quant_kernel", "_partials_scale_kernel", "_topk_sum_kernel"}
    assert set(TAKING_PDL) == set(KERNELS) | set(GEMM_TILES)
    assert {name.rsplit(".", 1)[1] for name in GEMM_TILES} == {"gemm1_tile", "gemm2_tile"}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_waits_before_anything_else(name):
    assert ast.unparse(_body(KERNELS[name])[0]) in ("dependent_launch_entry(PDL)", "wait_for_previous_kernel(PDL)")


def _ends_in_k_loop(node) -> bool:
    """A K loop: a for loop, a call of the two-halves loop (fused_moe._k_loop_halves), or a branch on the config
    whose every arm ends in one."""
    if isinstance(node, ast.If):
        return bool(node.orelse) and _ends_in_k_loop(node.body[-1]) and _ends_in_k_loop(node.orelse[-1])
    return isinstance(node, ast.For) or (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                                         and ast.unparse(node.value.func) == "_k_loop_halves")


@pytest.mark.parametrize("name", sorted(GEMM_TILES))
def test_a_gemm_tile_frees_the_next_launch_right_after_its_k_loop(name):
    body = _body(GEMM_TILES[name])
    lets = [i for i, node in enumerate(body) if ast.unparse(node) == "let_next_kernel_launch(PDL)"]
    assert len(lets) == 1 and _ends_in_k_loop(body[lets[0] - 1]), name
    assert "let_next_kernel_launch" not in ast.unparse(_k_loop_halves_source()), "the halves' loop frees nothing"


def _k_loop_halves_source() -> ast.FunctionDef:
    tree = ast.parse(inspect.getsource(fused_moe))
    return next(fn for fn in tree.body if isinstance(fn, ast.FunctionDef) and fn.name == "_k_loop_halves")


def test_off_the_gpu_kernels_launch_plainly():
    assert pdl.pdl_kwargs(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}
