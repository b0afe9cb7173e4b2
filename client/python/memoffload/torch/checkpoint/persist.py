"""The durable tier: a node checkpoint persisted to the job's durable
directory (its ``fallback_dir``) in DCP's own FileSystem layout.

Each rank writes its own regions of the checkpoint (``__<rank>_0.distcp``,
``__<rank>_1.distcp``) to files, byte for byte (``RegionStore.persist``:
C++, without the GIL, straight from the arena mapping, checked against the
regions' CRC32Cs, fsynced, throttled), into
``<durable>/.memoffload-persisting/<id>/``, then a small ``__<rank>.persisted``
record of what it wrote. The coordinator waits for every rank's record,
writes ``.metadata`` (the node checkpoint's, with DCP's ``_StorageInfo``
pointing at each item's ``torch.save`` record in those files, so that it
names torch's classes only), the job's marker, fsyncs, and publishes the
checkpoint with one rename to ``<durable>/<id>``. A persist killed at any
point leaves nothing visible: the next start of the job finishes it or
removes it (CheckpointManager.restore).

Every file and directory is opened through the durable dir's verified
descriptor (trusted_files), never by path, and what is read back is checked
to be this user's."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import os
import pickle
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata

from ... import _C, errors, logs
from . import outcome as _outcome
from . import store as _store
from . import trusted_files as _trusted_files
from .items import _RegionItem

PERSISTING = ".memoffload-persisting"
DONE_SUFFIX = ".persisted"  # __<rank>.persisted: what a rank wrote
PERSISTED_REGION = ".persisted"  # committed in the daemon once published


@dataclasses.dataclass
class Persisted:
    """What one rank wrote (``files``: name -> {bytes, crc32c}), or, on the
    coordinator after publishing, the checkpoint's whole figures."""

    checkpoint_id: str
    rank: int
    files: Dict[str, Dict[str, Any]]
    bytes: int = 0
    seconds: float = 0.0
    busy_seconds: float = 0.0
    direct: bool = False
    path: str = ""


def _subdir(parent_fd: int, name: str, where: str, create: bool) -> int:
    """Directory ``name`` below ``parent_fd`` (made 0700 with ``create``),
    opened without following a symlink and checked to be this user's and
    writable by nobody else."""
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=parent_fd)
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
    problem = _trusted_files._owner_problem(where, os.fstat(fd), "persist dir")
    if problem is not None:
        os.close(fd)
        raise _trusted_files.refused(problem)
    return fd


def job_dir(job_id: str) -> str:
    """The job's own dir below .memoffload-persisting: jobs sharing a
    durable dir never touch each other's unpublished persists."""
    return "job-" + hashlib.sha256(job_id.encode()).hexdigest()[:16]


def _where(durable_dir: str, job_id: str, checkpoint_id: str = "") -> str:
    return os.path.join(durable_dir, PERSISTING, job_dir(job_id), checkpoint_id)


@contextlib.contextmanager
def _jobs(durable_dir: str, job_id: str, create: bool):
    """(root, descriptor of .memoffload-persisting/<job>)."""
    with _trusted_files.trusted_fallback_dir(durable_dir, create=create) as root:
        pfd = _subdir(root.fd, PERSISTING, os.path.join(durable_dir, PERSISTING), create)
        try:
            jfd = _subdir(pfd, job_dir(job_id), _where(durable_dir, job_id), create)
        finally:
            os.close(pfd)
        try:
            yield root, jfd
        finally:
            os.close(jfd)


@contextlib.contextmanager
def _partial(durable_dir: str, job_id: str, checkpoint_id: str, create: bool):
    """(root, descriptor of .memoffload-persisting/<job>, of its <id>)."""
    with _jobs(durable_dir, job_id, create) as (root, jfd):
        cfd = _subdir(jfd, checkpoint_id, _where(durable_dir, job_id, checkpoint_id), create)
        try:
            yield root, jfd, cfd
        finally:
            os.close(cfd)


def _unlink(dir_fd: int, name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dir_fd)


def _exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False


def _write_file(root: _trusted_files.TrustedDir, dir_fd: int, name: str, data: bytes,
                where: str) -> None:
    """``name`` written whole (a temporary file, fsync, rename)."""
    tmp = f"{name}.{os.getpid()}.tmp"
    fd = root.open_file(dir_fd, tmp, os.path.join(where, tmp), write=True)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def shard_regions(store: Any, checkpoint_id: str, rank: int) -> List[str]:
    """This rank's data regions of the checkpoint in its daemon."""
    prefix = _store.region_name(checkpoint_id, f"__{rank}_")
    return sorted(r["name"] for r in store.list(prefix) if r["name"].endswith(".distcp"))


def open_shard(store: Any, checkpoint_id: str, rank: int) -> List[Tuple[str, Any]]:
    """This rank's regions of the checkpoint, open (verified as read) so that
    retention deleting them before their persist keeps their bytes:
    [(file name, reader)]. Raises NotFound when the daemon no longer has
    them."""
    regions = shard_regions(store, checkpoint_id, rank)
    if not regions:
        raise errors.NotFound(f"checkpoint {checkpoint_id!r}: rank {rank}'s regions are no longer "
                              "in the daemon (deleted by retention, or the daemon restarted)")
    shard: List[Tuple[str, Any]] = []
    try:
        for region in regions:
            shard.append((_store.split_region_name(region)[1],  # type: ignore[index]
                          store.open(region, True, verify_as_read=True)))
    except BaseException:
        close_shard(shard)
        raise
    return shard


def close_shard(shard: List[Tuple[str, Any]]) -> None:
    for _, reader in shard:
        try:
            reader.close()
        except errors.Error:
            pass  # a daemon gone: nothing is held any more


def persist_shard(shard: List[Tuple[str, Any]], durable_dir: str, job_id: str, checkpoint_id: str,
                  rank: int, token: str, share: float = 1.0, direct: bool = True,
                  piece_bytes: int = 64 << 20) -> Persisted:
    """Writes this rank's open regions (open_shard; closed here) into the
    checkpoint's persisting dir, then its ``__<rank>.persisted`` record
    (with ``token``, which the coordinator matches)."""
    try:
        return _persist_shard(shard, durable_dir, job_id, checkpoint_id, rank, token, share,
                              direct, piece_bytes)
    finally:
        close_shard(shard)


def _persist_shard(shard: List[Tuple[str, Any]], durable_dir: str, job_id: str, checkpoint_id: str,
                   rank: int, token: str, share: float, direct: bool, piece_bytes: int) -> Persisted:
    out = Persisted(checkpoint_id, rank, {})
    where = _where(durable_dir, job_id, checkpoint_id)
    with _partial(durable_dir, job_id, checkpoint_id, create=True) as (root, _, cfd):
        done = f"__{rank}{DONE_SUFFIX}"
        _unlink(cfd, done)
        for name, reader in shard:
            _unlink(cfd, name)  # what a killed attempt left
            stats = reader.persist(cfd, name, share=share, direct=direct, piece_bytes=piece_bytes)
            if _outcome.pause is not None:
                _outcome.pause("w", rank)  # one of its files written, its record not
            out.files[name] = {"bytes": int(stats["bytes"]), "crc32c": int(stats["crc32c"])}
            out.bytes += int(stats["bytes"])
            out.seconds += float(stats["seconds"])
            out.busy_seconds += float(stats["busy_seconds"])
            out.direct = out.direct or bool(stats["direct"])
        record = {"rank": rank, "token": token, "files": out.files}
        _write_file(root, cfd, done, json.dumps(record).encode(), where)
        os.fsync(cfd)
    return out


def record_failure(durable_dir: str, job_id: str, checkpoint_id: str, rank: int, token: str,
                   why: str) -> None:
    """This rank's record saying why it wrote nothing: the coordinator
    gives up now instead of at its timeout."""
    where = _where(durable_dir, job_id, checkpoint_id)
    with _partial(durable_dir, job_id, checkpoint_id, create=True) as (root, _, cfd):
        record = {"rank": rank, "token": token, "files": {}, "error": why}
        _write_file(root, cfd, f"__{rank}{DONE_SUFFIX}", json.dumps(record).encode(), where)


def durable_metadata(metadata: Metadata, files: Dict[str, Dict[str, Any]]) -> Metadata:
    """The node checkpoint's Metadata for its files: every item's
    ``_RegionItem`` becomes DCP's ``_StorageInfo`` (a tensor's: its whole
    torch.save record). Raises FailedPrecondition for a checkpoint saved
    before records were written."""
    storage: Dict[Any, _StorageInfo] = {}
    empty_file = min(files) if files else ""
    for index, info in (metadata.storage_data or {}).items():
        if not isinstance(info, _RegionItem):
            raise errors.FailedPrecondition(f"item {index} is not in a daemon region ({info!r})")
        name = _store.split_region_name(info.region)[1] if info.region else empty_file
        if info.region and name not in files:
            raise errors.FailedPrecondition(f"item {index} is in {name}, which no rank persisted")
        if info.dtype is None:
            storage[index] = _StorageInfo(name, info.offset, info.length)
        elif info.record is None:
            raise errors.FailedPrecondition(
                "it was saved by an older memoffload, whose regions hold no torch.save records")
        else:
            storage[index] = _StorageInfo(name, info.record[0], info.record[1])
    return Metadata(state_dict_metadata=metadata.state_dict_metadata,
                    planner_data=metadata.planner_data, storage_data=storage,
                    storage_meta=metadata.storage_meta, version=metadata.version)


def _records(root: _trusted_files.TrustedDir, cfd: int, where: str, world: int, token: str
             ) -> Optional[Dict[str, Dict[str, Any]]]:
    """Every rank's written files, once each rank's record (with ``token``)
    is there; None while some are missing."""
    files: Dict[str, Dict[str, Any]] = {}
    for rank in range(world):
        name = f"__{rank}{DONE_SUFFIX}"
        try:
            fd = root.open_file(cfd, name, os.path.join(where, name))
        except FileNotFoundError:
            return None
        except _trusted_files.Untrusted as exc:
            raise _trusted_files.refused(exc) from None
        with os.fdopen(fd, "rb") as f:
            record = json.loads(f.read(1 << 20))
        if record.get("token") != token or record.get("rank") != rank:
            return None  # a killed attempt's: this one's comes
        if record.get("error"):
            raise errors.FailedPrecondition(f"rank {rank} could not persist its shard: "
                                            f"{record['error']}")
        for file_name, figures in record["files"].items():
            st = os.stat(file_name, dir_fd=cfd, follow_symlinks=False)
            if st.st_size != figures["bytes"]:
                raise errors.DataLoss(f"{os.path.join(where, file_name)} has {st.st_size} bytes, "
                                      f"rank {rank} wrote {figures['bytes']}")
            files[file_name] = figures
    return files


def node_metadata(store: Any, checkpoint_id: str) -> Tuple[Metadata, float]:
    """The node checkpoint's Metadata and commit time, read when its persist
    is due (node retention may delete it before the publish)."""
    reader = store.open(_store.region_name(checkpoint_id, _store.METADATA_NAME), True)
    try:
        metadata: Metadata = pickle.loads(reader.read_bytes(0, reader.size_bytes))
    finally:
        reader.close()
    info = _store.stored_checkpoints(store).get(checkpoint_id)
    return metadata, (info.committed_unix if info is not None else time.time())


def publish(node: Tuple[Metadata, float], durable_dir: str, job_id: str, checkpoint_id: str,
            world: int, token: str, timeout_s: float) -> str:
    """On the coordinator: waits for every rank's files, writes ``.metadata``
    (from ``node``: node_metadata) last and publishes the checkpoint (a
    rename); returns its path."""
    where = _where(durable_dir, job_id, checkpoint_id)
    metadata, committed = node
    deadline = time.monotonic() + timeout_s
    with _partial(durable_dir, job_id, checkpoint_id, create=True) as (root, jfd, cfd):
        pause = 0.02
        while True:
            files = _records(root, cfd, where, world, token)
            if files is not None:
                break
            if time.monotonic() > deadline:
                missing = [r for r in range(world) if not _exists(cfd, f"__{r}{DONE_SUFFIX}")]
                raise errors.DeadlineExceeded(
                    f"checkpoint {checkpoint_id!r}: ranks {missing} did not persist their shards "
                    f"into {where} within {timeout_s:.0f} s (is {durable_dir} shared by every "
                    "node of the job?)")
            time.sleep(pause)
            pause = min(pause * 2, 0.5)
        if _outcome.pause is not None:
            _outcome.pause("m", 0)  # every shard written, no .metadata
        blob = pickle.dumps(durable_metadata(metadata, files))
        _write_file(root, cfd, _store.METADATA_NAME, blob, where)
        os.utime(_store.METADATA_NAME, (committed, committed), dir_fd=cfd, follow_symlinks=False)
        _write_file(root, cfd, _store.MARKER_NAME, (job_id + "\n").encode(), where)
        os.fsync(cfd)
        if _outcome.pause is not None:
            _outcome.pause("n", 0)  # .metadata written, not published
        _rename_out(root, jfd, durable_dir, checkpoint_id)
    return os.path.join(durable_dir, checkpoint_id)


def _rename_out(root: _trusted_files.TrustedDir, jfd: int, durable_dir: str,
                checkpoint_id: str) -> None:
    """Publishes the job's finished partial dir: one rename into the root."""
    try:
        os.rename(checkpoint_id, checkpoint_id, src_dir_fd=jfd, dst_dir_fd=root.fd)
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        try:
            owner = root.read(checkpoint_id, _store.MARKER_NAME).decode(errors="replace").strip()
        except (OSError, _trusted_files.Untrusted):
            owner = "?"
        raise errors.AlreadyExists(
            f"{os.path.join(durable_dir, checkpoint_id)} already exists (job {owner!r}); "
            f"checkpoint {checkpoint_id!r} was not persisted over it: give each job a durable "
            "dir of its own") from None
    os.fsync(root.fd)


def finish_partial(durable_dir: str, job_id: str, checkpoint_id: str) -> bool:
    """Publishes a partial dir whose ``.metadata`` was written (a persist
    killed between its last fsync and its rename); False when it has none."""
    with _partial(durable_dir, job_id, checkpoint_id, create=False) as (root, jfd, cfd):
        if not _exists(cfd, _store.METADATA_NAME) or not _exists(cfd, _store.MARKER_NAME):
            return False
        _rename_out(root, jfd, durable_dir, checkpoint_id)
        return True


def partial_ids(durable_dir: str, job_id: str) -> List[str]:
    """The job's checkpoint ids whose persist has not been published."""
    try:
        with _jobs(durable_dir, job_id, create=False) as (_, jfd):
            return sorted(os.listdir(jfd))
    except (FileNotFoundError, NotADirectoryError):
        return []
    except _trusted_files.Untrusted as exc:
        raise _trusted_files.refused(exc) from None


def remove_partial(durable_dir: str, job_id: str, checkpoint_id: str) -> bool:
    """Removes what an unpublished persist of ``checkpoint_id`` left; True
    when there was something."""
    try:
        with _jobs(durable_dir, job_id, create=False) as (_, jfd):
            _trusted_files._remove_tree(jfd, checkpoint_id)
            return True
    except (FileNotFoundError, NotADirectoryError):
        return False


def mark_persisted(store: Any, checkpoint_id: str) -> None:
    """Commits ``dcp/<id>/.persisted`` in the daemon (what
    ``memoffloadctl regions`` and ``CheckpointManager.status`` show); a
    failure is only said."""
    try:
        found = _store.stored_checkpoints(store).get(checkpoint_id)
        if found is None or not found.complete:
            return  # node retention deleted it meanwhile: no mark of nothing
        writer = store.create(_store.region_name(checkpoint_id, PERSISTED_REGION), 1)
        writer.append(b"1")
        writer.commit()
    except errors.AlreadyExists:
        pass  # persisted before (a second persist of the same checkpoint)
    except errors.Error as exc:
        logs.log(logging.INFO, f"checkpoint {checkpoint_id!r} is persisted, but its mark in the "
                 f"daemon could not be committed ({exc})", exc.code)



class DurableFile:
    """A persisted region file (a binary file object, local or fsspec's),
    read as a region reader is: the same bytes at the same offsets. Used
    by MemoffloadReader in place of a node region that is missing or
    damaged, after :meth:`verify`."""

    def __init__(self, f: Any, path: str, expect: Optional[int]) -> None:
        self.f = f
        self.path = path
        self.expect = expect  # its CRC32C, as its rank recorded it

    def __enter__(self) -> "DurableFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.f.close()

    def _read(self, offset: int, view: memoryview) -> int:
        self.f.seek(offset)
        done = 0
        while done < len(view):
            n = self.f.readinto(view[done:])
            if not n:
                break
            done += n
        return done

    def verify(self, piece: int = 64 << 20) -> None:
        """DataLoss unless the whole file has the recorded CRC32C."""
        if self.expect is None:
            raise errors.DataLoss(f"{self.path}: no checksum was recorded for it")
        buf = torch.empty(piece, dtype=torch.uint8)
        crc = at = 0
        while True:
            n = self._read(at, memoryview(buf.numpy()))
            if n == 0:
                break
            crc = _C.crc32c(buf[:n], crc)
            at += n
        if crc != self.expect:
            raise errors.DataLoss(f"{self.path}: its CRC32C is {crc:08x}, its rank wrote "
                                  f"{self.expect:08x}")

    def read_bytes(self, offset: int, length: int) -> bytes:
        data = bytearray(length)
        if self._read(offset, memoryview(data)) != length:
            raise errors.DataLoss(f"{self.path} ends before byte {offset + length}")
        return bytes(data)

    def read_into(self, offset: int, target: torch.Tensor) -> None:
        view = memoryview(target.reshape(-1).view(torch.uint8).numpy())
        if self._read(offset, view) != len(view):
            raise errors.DataLoss(f"{self.path} ends before byte {offset + len(view)}")
