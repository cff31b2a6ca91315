"""Programmatic dependent launch (kernels/triton/pdl.py): a kernel launched before the one ahead of it has finished
must not touch memory until that one has, so every kernel taking PDL starts by waiting for it."""

from __future__ import annotations

import ast
import inspect

import pytest
import torch

from moerules.kernels.triton import align, fused_moe, pdl, quant, topk_sum


def _kernels_taking_pdl():
    for module in (align, fused_moe, quant, topk_sum):
        tree = ast.parse(inspect.getsource(module))
        for fn in tree.body:
            if isinstance(fn, ast.FunctionDef) and "PDL" in [a.arg for a in fn.args.args]:
                yield f"{module.__name__}.{fn.name}", fn


KERNELS = dict(_kernels_taking_pdl())


def test_the_forward_kernels_launch_dependently():
    assert {name.rsplit(".", 1)[1] for name in KERNELS} == {
        "_count_kernel", "_run_offsets_kernel", "_one_program_align_kernel", "_block_experts_kernel",
        "_scatter_kernel", "gemm1_gated_kernel", "gemm2_weighted_kernel", "_tensor_amax_kernel",
        "_tensor_quant_kernel", "_token_quant_kernel", "_mx_dequant_kernel", "_group_quant_kernel",
        "_partials_scale_kernel", "_topk_sum_kernel"}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_waits_before_anything_else(name):
    body = KERNELS[name].body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):  # the docstring
        body = body[1:]
    first = ast.unparse(body[0])
    assert first in ("dependent_launch_entry(PDL)", "wait_for_previous_kernel(PDL)"), name
    if first == "wait_for_previous_kernel(PDL)":  # the GEMMs free the next launch right after their K loop
        lets = list(_lets_after(body))
        assert lets and all(_ends_k_loop(before) for before in lets), name


def _lets_after(body: list):
    """The statements each `let_next_kernel_launch(PDL)` of body (and of its ifs' branches) follows, in lists."""
    for i, node in enumerate(body):
        if ast.unparse(node) == "let_next_kernel_launch(PDL)":
            yield body[:i]
        if isinstance(node, ast.If):
            yield from _lets_after(node.body)
            yield from _lets_after(node.orelse)


def _ends_k_loop(before: list) -> bool:
    """The K loop just ran: a for loop last, or after it GEMM1's prefetch of GEMM2's weights (nothing that waits
    on memory), or the summed GEMM2's tile (its K loop is that function's body)."""
    last = before[-1] if before else None
    if isinstance(last, ast.If) and ast.unparse(last.test) == "PREFETCH_W2 == 2":
        last = before[-2] if len(before) > 1 else None
    return isinstance(last, ast.For) or (last is not None and "_summed_slots_tile(" in ast.unparse(last))


def test_off_the_gpu_kernels_launch_plainly():
    assert pdl.pdl_kwargs(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}
