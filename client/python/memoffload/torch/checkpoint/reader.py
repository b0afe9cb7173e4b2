"""DCP reading of checkpoints written by
:class:`memoffload.torch.checkpoint.MemoffloadWriter` (re-exported there)."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import pickle
import uuid
from typing import Any, Dict, List, Optional

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ... import errors, logs
from . import durable_url as _durable_url
from . import persist as _persist
from . import store as _store
from .nodes import link as _link
from .nodes import load as _node_load
from . import trusted_files as _trusted_files
from .items import DAEMON, FILESYSTEM, _rank_of, _RegionItem, _unreachable, _warn_fallback

__all__ = ["MemoffloadReader"]


class MemoffloadReader(StorageReader):
    """A DCP StorageReader of checkpoints written by :class:`MemoffloadWriter`:
    from the daemon's regions when the checkpoint is there, else (with one
    warning) from ``<fallback_dir>/<id>``. ``verify``: check the CRC32C of
    each checksummed region, as its items are copied out (memoffload.DataLoss
    on a mismatch; the load then fails, and the state dict may hold part of
    the bad checkpoint). Other arguments as for the writer.

    On a job whose ranks use the daemons of several nodes, each region comes
    from this node's daemon when it is there and intact (verified whole
    before it is read), else from the daemon of another node that holds a
    copy, streamed by one of that node's ranks; ``last_sources`` says which
    served each region, and one INFO line per rank counts them."""

    def __init__(
        self,
        checkpoint_id: Optional[str] = None,
        *,
        job_id: Optional[str] = None,
        runtime_dir: str = "",
        fallback_dir: Optional[str] = None,
        verify: bool = True,
        rpc_timeout_ms: int = 30000,
    ) -> None:
        super().__init__()
        self.job_id = _store.job_id_of(job_id)
        self.runtime_dir = runtime_dir or ""
        self.fallback_dir = _store.fallback_dir_of(fallback_dir, self.job_id)
        self.verify = verify
        self.rpc_timeout_ms = rpc_timeout_ms
        self.checkpoint_id: Optional[str] = (
            None if checkpoint_id is None else _store.checked_checkpoint_id(checkpoint_id))
        self.load_id = str(uuid.uuid4())
        self.storage_data: Dict[Any, Any] = {}
        self.last_mode = ""
        self._region_store: Optional[Any] = None
        self._fs: Optional[FileSystemReader] = None
        self._link: Optional[_link.Link] = None
        self.last_sources: Dict[str, str] = {}

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id:
            self.checkpoint_id = _store.checked_checkpoint_id(checkpoint_id)
        self.load_id = str(uuid.uuid4())
        self.storage_data = {}
        self.last_mode = ""
        self._fs = None
        self.last_sources = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return _store.checkpoint_id_problem(checkpoint_id) is None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise FileNotFoundError("memoffload checkpoints have one global .metadata, no per-rank one")
        if self.checkpoint_id is None:
            raise ValueError("MemoffloadReader needs a checkpoint id: dcp.load(..., checkpoint_id=...) "
                             "(latest_checkpoint() names the newest)")
        runtime_dir = _store.runtime_dir_of(self.runtime_dir)
        store, reason = _store.attach(self.runtime_dir, self.job_id, _rank_of(None), True,
                                      self.rpc_timeout_ms)
        self._link = _link.multi_node(self.runtime_dir, store)
        blob: Optional[bytes] = None
        if store is not None:
            name = _store.region_name(self.checkpoint_id, _store.METADATA_NAME)
            try:
                reader = store.open(name, self.verify)
            except errors.Unavailable as exc:
                _store.forget(store)
                store = None
                why = _unreachable(runtime_dir, str(exc))
            except (errors.NotFound, errors.DataLoss) as exc:
                if self._link is None and isinstance(exc, errors.DataLoss):
                    raise
                why = f"the memoffload daemon at {runtime_dir} has no checkpoint {self.checkpoint_id!r} " \
                      f"of job {self.job_id!r}"
            else:
                try:
                    blob = reader.read_bytes(0, reader.size_bytes)
                finally:
                    reader.close()
        else:
            why = _unreachable(runtime_dir, reason)
        if self._link is not None:  # every rank, so that the collective pairs up
            blob = _node_load.metadata(self._link, store, blob)
        if blob is not None:
            self._region_store = store
            self.last_mode = DAEMON
            return self._stamped(pickle.loads(blob))
        if _durable_url.is_url(self.fallback_dir):  # the manager's durable tier in an object store
            return self._from_url(why)
        path = os.path.join(self.fallback_dir, self.checkpoint_id)
        # Every file is opened through the fallback dir's verified
        # descriptor and checked before a byte is unpickled (_trusted_files).
        try:
            fs = _trusted_files.TrustedFileSystem(_trusted_files.trusted_fallback_dir(self.fallback_dir))
            os.close(fs.root.open_checkpoint(self.checkpoint_id, check_files=True))
            found = fs.exists(os.path.join(path, _store.METADATA_NAME))
        except (FileNotFoundError, NotADirectoryError):
            found = False
        except _trusted_files.Untrusted as exc:
            raise _trusted_files.refused(exc) from None
        if not found:
            raise FileNotFoundError(f"checkpoint {self.checkpoint_id!r} not found: {why}, and {path} "
                                    f"has no {_store.METADATA_NAME}")
        _warn_fallback("load", why, path)
        self._fs = FileSystemReader(path)
        self._fs.fs = fs
        self.last_mode = FILESYSTEM
        return self._stamped(self._fs.read_metadata())

    def _from_url(self, why: str) -> Metadata:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        assert self.checkpoint_id is not None
        url = f"{self.fallback_dir}/{self.checkpoint_id}"
        if self.checkpoint_id not in _durable_url.checkpoints(self.fallback_dir, self.job_id):
            raise FileNotFoundError(f"checkpoint {self.checkpoint_id!r} not found: {why}, and {url} "
                                    f"has no {_store.METADATA_NAME} of job {self.job_id!r}")
        _warn_fallback("load", why, url)
        self._fs = FsspecReader(url)
        self.last_mode = FILESYSTEM
        return self._stamped(self._fs.read_metadata())

    def _stamped(self, metadata: Metadata) -> Metadata:
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        if self._fs is not None:
            self._fs.set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
            return
        if metadata.storage_data is None:
            raise AssertionError("storage_data must not be None in metadata")
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return dataclasses.replace(plan, storage_data=(_rank_of(None), self.last_mode))

    def prepare_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        modes = {mode for _, mode in (p.storage_data for p in plans)}
        if len(modes) > 1:
            where = ", ".join(f"rank {r}: {m}" for r, m in (p.storage_data for p in plans))
            raise RuntimeError(
                f"checkpoint {self.checkpoint_id!r}: the ranks read it from different places ({where})")
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._fs is not None:
            return self._fs.read_data(plan, planner)
        readers: Dict[str, Any] = {}
        if self._link is not None:
            readers = self._fetch_across_nodes(plan)
        by_region: Dict[str, List[Any]] = {}
        for req in plan.items:
            by_region.setdefault(self.storage_data[req.storage_index].region, []).append(req)
        try:
            for region, reqs in by_region.items():
                try:
                    reader = readers.get(region)
                    if reader is None and region:
                        # Checksums are checked as the items are copied out
                        # (in region order, the order they were written), and
                        # what no read covered, at the end: one pass.
                        assert self._region_store is not None
                        reader = readers[region] = self._region_store.open(
                            region, self.verify, verify_as_read=True)
                    self._read_items(reader, reqs, planner)
                    if reader is not None:
                        reader.verify_rest()
                except (errors.NotFound, errors.DataLoss) as exc:
                    # The same bytes at the same offsets in the durable tier's
                    # file, when this checkpoint was persisted (persist.py).
                    durable = self._durable_file(region)
                    if durable is None:
                        raise
                    logs.log(logging.WARNING, f"checkpoint {self.checkpoint_id!r}: {region} "
                             f"is read from durable storage ({durable.path}): {exc}", exc.code)
                    with durable:
                        durable.verify()  # the CRC32C its rank recorded, before a byte is used
                        self._read_items(durable, reqs, planner)
                    self.last_sources[region] = f"durable storage ({durable.path})"
        finally:
            for reader in readers.values():
                reader.close()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_items(self, reader: Any, reqs: List[Any], planner: LoadPlanner) -> None:
        for req in reqs:
            info: _RegionItem = self.storage_data[req.storage_index]
            if req.type == LoadItemType.BYTE_IO:
                blob = reader.read_bytes(info.offset, info.length) if info.length else b""
                planner.load_bytes(req, io.BytesIO(blob))
                continue
            target = planner.resolve_tensor(req).detach()
            _read_tensor(reader, info, req.storage_offsets, req.lengths, target, req.storage_index)
            planner.commit_tensor(req, target)

    def _durable_file(self, region: str) -> Optional[Any]:
        """The persisted file of ``region`` in the published checkpoint of
        the durable dir (the fallback dir), opened through its verified
        descriptor, or None."""
        parts = _store.split_region_name(region)
        if parts is None or self.checkpoint_id is None:
            return None
        name = parts[1]
        if _durable_url.is_url(self.fallback_dir):
            return _durable_url.open_file(self.fallback_dir, self.checkpoint_id, name)
        try:
            with _trusted_files.open_fallback_dir(self.fallback_dir) as root:
                ckpt_fd = root.open_checkpoint(self.checkpoint_id, check_files=True)
                try:
                    if not root.contains(self.checkpoint_id, _store.METADATA_NAME):
                        return None
                    rank = name[2:].split("_")[0]
                    record = json.loads(root.read(self.checkpoint_id, f"__{rank}.persisted"))
                    expect = record["files"][name].get("crc32c")
                    path = os.path.join(self.fallback_dir, self.checkpoint_id, name)
                    return _persist.DurableFile(
                        os.fdopen(root.open_file(ckpt_fd, name, path), "rb"), path, expect)
                finally:
                    os.close(ckpt_fd)
        except (OSError, ValueError, KeyError, _trusted_files.Untrusted):
            return None  # no published copy of it, or not one of ours

    def _fetch_across_nodes(self, plan: LoadPlan) -> Dict[str, Any]:
        """Readers of every region this rank needs, from its node or another
        (_node_load.fetch, a collective: every rank calls it), already
        verified whole."""
        assert self._link is not None and self.checkpoint_id is not None
        needed = sorted({self.storage_data[req.storage_index].region for req in plan.items
                         if self.storage_data[req.storage_index].length})
        readers, self.last_sources = _node_load.fetch(
            self._link, self._region_store, self.checkpoint_id, needed, self.verify)
        local = sum(1 for where in self.last_sources.values() if where == _node_load.LOCAL)
        remote = "".join(f"; {name} from {where}" for name, where in sorted(self.last_sources.items())
                         if where != _node_load.LOCAL)
        logs.log(logging.INFO, f"checkpoint {self.checkpoint_id!r}: {local} region(s) from this node's "
                 f"daemon, {len(self.last_sources) - local} from other nodes{remote}",
                 errors.StatusCode.OK)
        return readers


def _read_tensor(reader: Any, info: _RegionItem, offsets: Any, lengths: Any,
                 target: torch.Tensor, index: Any) -> None:
    """Copies the stored chunk, narrowed to ``offsets``/``lengths`` as
    FileSystemReader narrows it, into ``target``: straight from the region
    when the whole chunk is wanted in a matching CPU tensor."""
    assert info.dtype is not None and info.shape is not None
    whole = all(o == 0 for o in offsets) and tuple(lengths) == info.shape
    if (whole and target.device.type == "cpu" and target.dtype == info.dtype
            and tuple(target.shape) == info.shape and target.is_contiguous()):
        if info.length:
            reader.read_into(info.offset, target)
        return
    chunk = torch.empty(info.shape, dtype=info.dtype)
    if info.length:
        reader.read_into(info.offset, chunk)
    chunk = narrow_tensor_by_index(chunk, offsets, lengths)
    if target.size() != chunk.size():
        raise AssertionError(f"req {index} mismatch sizes {target.size()} vs {chunk.size()}")
    target.copy_(chunk)

