"""The durable tier in an object store (or any fsspec file system): a
``durable_dir`` that is a URL (``s3://bucket/ckpt/run-42``, ``gs://...``,
``file:///...``) goes through fsspec, as DCP's ``FsspecWriter`` /
``FsspecReader`` do, instead of the local, descriptor-checked path of
persist.py.

The layout is the same (DCP's own, readable by ``FsspecReader``). An object
store has no rename: each rank writes its files straight into ``<url>/<id>/``
followed by its ``__<rank>.persisted`` record; the coordinator writes the
job's marker and then ``.metadata``, last. A checkpoint without ``.metadata``
is not one (DCP's own rule): a persist killed before it leaves no
checkpoint, and the next ``restore()`` removes what it left.

Trust: what the bucket's access control lets write the URL can write the
``.metadata`` pickle the loader unpickles, as for DCP's own ``FsspecReader``.
A file read back in place of a node region (MemoffloadReader's per-piece
fallback) is first checked against the CRC32C its rank recorded."""

from __future__ import annotations

import json
import os
import pickle
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint.metadata import Metadata

from ... import _C, errors
from . import outcome as _outcome
from . import store as _store


def is_url(path: Optional[str]) -> bool:
    return bool(path) and "://" in str(path)


def _fs(url: str) -> Tuple[Any, str]:
    from fsspec.core import url_to_fs

    return url_to_fs(url)


def _join(*parts: str) -> str:
    return "/".join(p.rstrip("/") for p in parts)


def persist_shard(shard: List[Tuple[str, Any]], url: str, job_id: str, checkpoint_id: str,
                  rank: int, token: str, share: float = 1.0, direct: bool = True,
                  piece_bytes: int = 64 << 20) -> Any:
    """This rank's open regions (persist.open_shard; closed here) into
    ``<url>/<id>/``, read from the arena in pieces (verified as read) and
    written through fsspec, then its record."""
    from .persist import close_shard

    try:
        return _persist_shard(shard, url, job_id, checkpoint_id, rank, token, share, piece_bytes)
    finally:
        close_shard(shard)


def _owner(fs: Any, where: str) -> Optional[str]:
    """The job whose files are in ``where``: its marker's, else any rank's
    record's; None when there is nothing."""
    try:
        with fs.open(_join(where, _store.MARKER_NAME), "rb") as f:
            return f.read(4096).decode(errors="replace").splitlines()[0]
    except (FileNotFoundError, IndexError):
        pass
    from .persist import DONE_SUFFIX

    try:
        names = fs.ls(where, detail=False)
    except FileNotFoundError:
        return None
    for name in names:
        if name.endswith(DONE_SUFFIX):
            with fs.open(name, "rb") as f:
                try:
                    return str(json.loads(f.read(1 << 20)).get("job"))
                except ValueError:
                    continue
    return None


def _claim(fs: Any, where: str, url: str, job_id: str, checkpoint_id: str) -> None:
    """Refuses to write into another job's checkpoint dir (an object store
    has no per-job partial dir: both would write the same files)."""
    owner = _owner(fs, where)
    if owner is not None and owner != job_id:
        raise errors.AlreadyExists(f"{_join(url, checkpoint_id)} holds job {owner!r}'s files; "
                                   f"checkpoint {checkpoint_id!r} of job {job_id!r} was not "
                                   "persisted over them: give each job a durable dir of its own")


def _persist_shard(shard: List[Tuple[str, Any]], url: str, job_id: str, checkpoint_id: str,
                   rank: int, token: str, share: float, piece_bytes: int) -> Any:
    from .persist import DONE_SUFFIX, Persisted

    fs, root = _fs(url)
    where = _join(root, checkpoint_id)
    _claim(fs, where, url, job_id, checkpoint_id)
    fs.makedirs(where, exist_ok=True)
    out = Persisted(checkpoint_id, rank, {}, path=_join(url, checkpoint_id))
    buf = torch.empty(piece_bytes, dtype=torch.uint8)
    started = time.perf_counter()
    for name, reader in shard:
        size = reader.size_bytes
        crc = 0
        with fs.open(_join(where, name), "wb") as f:
            for at in range(0, size, piece_bytes):
                busy = time.perf_counter()
                n = min(piece_bytes, size - at)
                reader.read_into(at, buf[:n])
                crc = _C.crc32c(buf[:n], crc)
                f.write(memoryview(buf[:n].numpy()))
                took = time.perf_counter() - busy
                out.busy_seconds += took
                if share < 1:
                    time.sleep(took * (1 / share - 1))
        reader.verify_rest()  # a damaged region: its file is not recorded, never published
        out.files[name] = {"bytes": size, "crc32c": crc}
        out.bytes += size
        if _outcome.pause is not None:
            _outcome.pause("w", rank)
    out.seconds = time.perf_counter() - started
    with fs.open(_join(where, f"__{rank}{DONE_SUFFIX}"), "wb") as f:
        f.write(json.dumps({"rank": rank, "token": token, "job": job_id,
                            "files": out.files}).encode())
    return out


def record_failure(url: str, job_id: str, checkpoint_id: str, rank: int, token: str,
                   why: str) -> None:
    from .persist import DONE_SUFFIX

    fs, root = _fs(url)
    where = _join(root, checkpoint_id)
    _claim(fs, where, url, job_id, checkpoint_id)
    fs.makedirs(where, exist_ok=True)
    with fs.open(_join(where, f"__{rank}{DONE_SUFFIX}"), "wb") as f:
        f.write(json.dumps({"rank": rank, "token": token, "job": job_id, "files": {},
                            "error": why}).encode())


def _records(fs: Any, where: str, world: int, token: str) -> Optional[Dict[str, Dict[str, Any]]]:
    from .persist import DONE_SUFFIX

    files: Dict[str, Dict[str, Any]] = {}
    for rank in range(world):
        path = _join(where, f"__{rank}{DONE_SUFFIX}")
        if not fs.exists(path):
            return None
        with fs.open(path, "rb") as f:
            record = json.loads(f.read(1 << 20))
        if record.get("token") != token or record.get("rank") != rank:
            return None
        if record.get("error"):
            raise errors.FailedPrecondition(f"rank {rank} could not persist its shard: "
                                            f"{record['error']}")
        for name, figures in record["files"].items():
            size = fs.size(_join(where, name))
            if size != figures["bytes"]:
                raise errors.DataLoss(f"{_join(where, name)} has {size} bytes, rank {rank} "
                                      f"wrote {figures['bytes']}")
            files[name] = figures
    return files


def publish(node: Tuple[Metadata, float], url: str, job_id: str, checkpoint_id: str, world: int,
            token: str, timeout_s: float) -> str:
    """On the coordinator: every rank's record, then the marker, then
    ``.metadata`` (from ``node``: persist.node_metadata) last."""
    from .persist import durable_metadata

    fs, root = _fs(url)
    where = _join(root, checkpoint_id)
    metadata, committed = node
    deadline = time.monotonic() + timeout_s
    pause = 0.02
    while True:
        files = _records(fs, where, world, token)
        if files is not None:
            break
        if time.monotonic() > deadline:
            raise errors.DeadlineExceeded(f"checkpoint {checkpoint_id!r}: not every rank persisted "
                                          f"its shard into {_join(url, checkpoint_id)} within "
                                          f"{timeout_s:.0f} s")
        time.sleep(pause)
        pause = min(pause * 2, 0.5)
    if _outcome.pause is not None:
        _outcome.pause("m", 0)
    blob = pickle.dumps(durable_metadata(metadata, files))  # before any file: a failure leaves none
    _put(fs, _join(where, _store.MARKER_NAME), f"{job_id}\n{committed!r}\n".encode())
    _put(fs, _join(where, _store.METADATA_NAME), blob)
    return _join(url, checkpoint_id)


def _put(fs: Any, path: str, data: bytes) -> None:
    """``data`` at ``path`` whole or not at all: written under another name,
    then moved (a rename on a local file system; an object store's copy
    makes the object appear whole)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    fs.pipe_file(tmp, data)
    fs.mv(tmp, path)


def checkpoints(url: str, job_id: str) -> Dict[str, float]:
    """{checkpoint id: its node commit time} of the job's published
    checkpoints under ``url``."""
    fs, root = _fs(url)
    found: Dict[str, float] = {}
    try:
        entries = fs.ls(root, detail=False)
    except FileNotFoundError:
        return found
    for entry in entries:
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        base = _join(root, name)
        try:
            if fs.size(_join(base, _store.METADATA_NAME)) == 0:
                continue  # never a checkpoint (a writer that did not finish it)
        except (FileNotFoundError, OSError):
            continue
        try:
            with fs.open(_join(base, _store.MARKER_NAME), "rb") as f:
                lines = f.read(4096).decode(errors="replace").splitlines()
        except FileNotFoundError:
            continue
        if lines and lines[0] == job_id:
            found[name] = float(lines[1]) if len(lines) > 1 else 0.0
    return found


def partial_ids(url: str, job_id: str) -> List[str]:
    """The job's ids with a rank's record but no ``.metadata``: unpublished
    persists."""
    fs, root = _fs(url)
    try:
        entries = fs.ls(root, detail=False)
    except FileNotFoundError:
        return []
    out = []
    for entry in entries:
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        base = _join(root, name)
        if (fs.isdir(base) and not fs.exists(_join(base, _store.METADATA_NAME))
                and _owner(fs, base) == job_id):
            out.append(name)
    return sorted(out)


def remove(url: str, checkpoint_id: str) -> None:
    """``.metadata`` first (no longer a checkpoint), then the rest."""
    fs, root = _fs(url)
    base = _join(root, checkpoint_id)
    if fs.exists(_join(base, _store.METADATA_NAME)):
        fs.rm(_join(base, _store.METADATA_NAME))
    if fs.exists(base):
        fs.rm(base, recursive=True)


def remove_partial(url: str, job_id: str, checkpoint_id: str) -> None:
    """What an unpublished persist of the job left (never another job's)."""
    fs, root = _fs(url)
    base = _join(root, checkpoint_id)
    if not fs.exists(_join(base, _store.METADATA_NAME)) and _owner(fs, base) in (None, job_id):
        if fs.exists(base):
            fs.rm(base, recursive=True)


def retain(url: str, job_id: str, keep_last: Optional[int], current_id: str) -> List[str]:
    if keep_last is None:
        return []
    doomed = _store.retention_doomed(checkpoints(url, job_id), keep_last, current_id)
    for checkpoint_id in doomed:
        remove(url, checkpoint_id)
    return doomed


def open_file(url: str, checkpoint_id: str, name: str) -> Optional[Any]:
    """A published checkpoint's file, with the CRC32C its rank recorded
    (persist.DurableFile)."""
    from .persist import DONE_SUFFIX, DurableFile

    fs, root = _fs(url)
    if not fs.exists(_join(root, checkpoint_id, _store.METADATA_NAME)):
        return None
    try:
        rank = name[2:].split("_")[0]
        with fs.open(_join(root, checkpoint_id, f"__{rank}{DONE_SUFFIX}"), "rb") as f:
            record = json.loads(f.read(1 << 20))
        expect = record["files"].get(name, {}).get("crc32c")
        return DurableFile(fs.open(_join(root, checkpoint_id, name), "rb"),
                           _join(url, checkpoint_id, name), expect)
    except (FileNotFoundError, ValueError):
        return None
