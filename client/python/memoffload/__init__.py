"""memoffload: offload activations into the node's memoffloadd arena.

The PyTorch integration lives in :mod:`memoffload.torch`::

    import memoffload.torch as mot
    handle = mot.offload_layers(model.layers)

Importing this package does not import torch; ``memoffload.torch`` does, and
loads the native extension ``memoffload._C`` built against that torch. The
error classes (:class:`Error` and one subclass per status code, each with
``.code``) are importable from here without torch.
"""

from .errors import *  # noqa: F401,F403
from .errors import __all__ as _error_names

__all__ = ["__version__", *_error_names]
__version__ = "0.1.0"
