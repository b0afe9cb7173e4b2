"""torch.distributed.checkpoint (DCP) into the node daemon's arena.

::

    import torch.distributed.checkpoint as dcp
    from memoffload.torch.checkpoint import MemoffloadWriter, MemoffloadReader, latest_checkpoint

    writer = MemoffloadWriter(job_id="run-42", fallback_dir="/ckpt/run-42", keep_last=2)
    dcp.save(state, storage_writer=writer, checkpoint_id=f"step-{step}")
    ...
    ckpt = latest_checkpoint(job_id="run-42", fallback_dir="/ckpt/run-42")   # after a restart
    dcp.load(state, storage_reader=MemoffloadReader(job_id="run-42", fallback_dir="/ckpt/run-42"),
             checkpoint_id=ckpt)

Each rank writes its items into one region, ``dcp/<id>/__<rank>_0.distcp``:
raw tensor bytes and the bytes of DCP's BYTE_IO items, back to back. The
coordinator then commits ``dcp/<id>/.metadata`` (the pickled DCP Metadata
whose storage_data names region, offset and length of every item), last: a
checkpoint is complete iff that region exists, so a save killed half-way never
reads as complete. Only after that commit are older checkpoints deleted
(``keep_last``).

When some rank cannot reach a daemon, every rank writes a normal DCP
filesystem checkpoint into ``<fallback_dir>/<id>`` instead (the decision is
made once, by the coordinator, from every rank's local plan), and each rank
logs one warning naming the runtime dir, the reason and the path. The reader
takes the daemon's copy when there is one, else the fallback directory's.

Regions are owned by (uid, job id): a restarted job finds its checkpoints
only with the same explicit job id (``job_id=`` or ``$MEMOFFLOAD_JOB_ID``).
They do not survive a restart of the daemon (docs/checkpoints.md).
"""

from .items import _RegionItem  # noqa: F401 - the name every .metadata in a daemon pickles
from .latest import latest_checkpoint
from .manager import CheckpointManager
from .nodes.save import Replication
from .outcome import SaveResult
from .reader import MemoffloadReader
from .writer import MemoffloadWriter

# What lives here (each module imports only those listed before it, and
# memoffload.torch's _native and _settings; never activations/ or state/):
#   trusted_files  which fallback files are trusted, and the only way they are opened
#   store          regions and fallback dirs of a job: names, attach, listing, retention
#   items          what a save's plans and .metadata carry (_RegionItem)
#   stage          dcp.async_save staged straight into a region
#   nodes/         a job on several nodes: the link between them (link), a
#                  save's .metadata, .layout and replicas on every node (save),
#                  a load of what this node lacks (load)
#   outcome        where a save went (SaveResult), on_error, the test pause hooks
#   inflight       one save at a time per process
#   region_writes, file_writes   a rank's shard into regions, or into files
#   frames         the torch.save record around each tensor of a region
#   latest, reader, writer   the public names below
#   persist        the durable tier: a node checkpoint to files, published with a rename
#   manager        CheckpointManager: the tiers, their retention, restore
__all__ = ["CheckpointManager", "MemoffloadWriter", "MemoffloadReader", "latest_checkpoint"]
