"""Triton kernels: token alignment, fused MoE GEMMs, activation quantisation."""
