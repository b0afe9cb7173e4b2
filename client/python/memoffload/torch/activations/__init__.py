"""Activation offload: saved tensors of a layer (a group) into the arena in
forward, back one prefetch window ahead in backward.

``offloaders`` (one native session per runtime dir and job id), ``hooks``
(the saved-tensor hooks), ``handle`` (OffloadHandle), ``layers``
(offload_layers, find_layer_stack), ``functional`` (offload_activations),
``counters`` (the shapes of ``stats()``), ``selection``, ``param_skip``,
``checkpointing`` (activation checkpointing composed with offload),
``module_names``, ``hf`` (the Hugging Face callback, loaded on first use).

May import memoffload.torch's _native and _settings and the torch-free top
package; never state/ or checkpoint/. The public names are
memoffload.torch's.
"""
