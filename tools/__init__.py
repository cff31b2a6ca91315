"""The tools: the CLI, the golden matrix, lint, diff, mutate, conformance and platform probing.

The top layer: it imports the vocabulary, the engine and the kernels, and nothing imports it.
"""
