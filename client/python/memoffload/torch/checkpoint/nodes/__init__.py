"""Checkpoints of a job whose ranks use the daemons of several nodes.

``link``: the job's own connection between its nodes (a gloo group over the
job's store, its own addresses), topology and the agreement step before each
collective job. ``save``: after a save, the checkpoint's ``.metadata`` and
``.layout`` on every node, replicas of each rank's shard on the next nodes,
the node-safe marker. ``load``: a load streams the regions its node lacks
from a node that holds them.

May import memoffload.torch.checkpoint's store, items and trusted_files, and
memoffload.torch's _native and _settings; never the checkpoint package's
writer, reader or latest (they import this), nor activations/ or state/.
"""
