"""memoffload: offload activations into the node's memoffloadd arena.

The PyTorch integration lives in :mod:`memoffload.torch`::

    import memoffload.torch as mot
    handle = mot.offload_layers(model.layers)

Importing this package does not import torch; ``memoffload.torch`` does, and
loads the native extension ``memoffload._C`` built against that torch.
"""

__all__ = ["__version__"]
__version__ = "0.1.0"
