"""Model and optimizer state in the arena (``place_state``): FSDP2's
CPU-offloaded parameter shards, a CPU optimizer's state and the gradients a
trainer keeps, exact size, freed when the rank dies. ``placement`` holds it.

May import memoffload.torch's _native and _settings and the torch-free top
package; never activations/ or checkpoint/. The public names are
memoffload.torch's.
"""
