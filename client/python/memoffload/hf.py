"""Hugging Face ``Trainer`` integration: ``from memoffload.hf import
MemoffloadCallback`` (also ``memoffload.torch.MemoffloadCallback``). The
callback lives in ``memoffload.torch._hf``; see its docstring."""

from .torch._hf import LOGGED_KEYS, MemoffloadCallback

__all__ = ["MemoffloadCallback", "LOGGED_KEYS"]
