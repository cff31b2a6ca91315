"""Bridges to other libraries: Hugging Face checkpoints and transformers models (they import torch)."""
