"""Hugging Face ``Trainer`` integration: ``from memoffload.hf import
MemoffloadCallback`` (also ``memoffload.torch.MemoffloadCallback``). The
callback lives in ``memoffload.torch.activations.hf``; see its docstring."""

from .torch.activations.hf import LOGGED_KEYS, MemoffloadCallback

__all__ = ["MemoffloadCallback", "LOGGED_KEYS"]
