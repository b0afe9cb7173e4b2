"""How :class:`MemoffloadWriter` writes a save to the fallback dir: a rank's
shard as DCP's FileSystemWriter writes it (every file opened through the
dir's verified descriptor), the ``.metadata`` last, and a dir a skipped
save left without ``.metadata`` removed."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import List

from torch.distributed.checkpoint.filesystem import FileSystemWriter, _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult

from ... import errors, logs
from . import outcome as _outcome
from . import store as _store
from . import trusted_files as _trusted_files
from .items import _warn_fallback
from .nodes.save import Replication
from .outcome import FILESYSTEM, SKIPPED, SaveResult, _RankOutcome


class FileWrites:
    """The fallback half of MemoffloadWriter (its state lives there)."""

    def _to_files(self, plan: SavePlan, planner: SavePlanner, prefix: _StoragePrefix, why: str,
                  code: int = int(errors.StatusCode.UNAVAILABLE)) -> List[WriteResult]:
        """This rank's shard as DCP's FileSystemWriter writes it, in the
        fallback dir, and its outcome (SKIPPED when the files fail too)."""
        assert self.checkpoint_id is not None and self.fallback_dir is not None
        path = os.path.join(self.fallback_dir, self.checkpoint_id)
        try:
            # Every file is opened through the fallback dir's verified
            # descriptor (_trusted_files), never by path.
            fs = _trusted_files.TrustedFileSystem(
                _trusted_files.trusted_fallback_dir(self.fallback_dir, create=True))
            if fs.exists(path):
                try:
                    os.close(fs.root.open_checkpoint(self.checkpoint_id, check_files=True))
                except _trusted_files.Untrusted as exc:
                    raise _trusted_files.refused(exc) from None
            _warn_fallback("save", why, path, f"{code} {self.runtime_dir} {self.fallback_dir}")
            if self._link is not None or self.replicas > 0:
                self.last_replication = Replication(
                    self.checkpoint_id, False, why=f"saved to the filesystem fallback ({why})")
            self._fs = FileSystemWriter(path, sync_files=self.sync_files)
            self._fs.fs = fs
            self._fs.set_up_storage_writer(self._is_coordinator, rank=self._rank)
            fs.mkdir(path)
            _store.write_marker(fs, path, self.job_id)
            fs_fut = self._fs.write_data(dataclasses.replace(plan, storage_data=prefix), planner)
            fs_fut.wait()
            results = fs_fut.value()
        except Exception as exc:
            if not _outcome.is_node_failure(exc) or self.on_error == "raise":
                raise
            self.last_mode = SKIPPED
            return [_outcome.outcome_result(_RankOutcome(
                self._rank, SKIPPED, f"rank {self._rank}: writing {path}: {exc}",
                _outcome.code_of(exc)))]
        finally:
            # Written from the staged tensors (still mapped): the regions are not needed.
            self._drop_staged()
            self._release()
        self.last_mode = FILESYSTEM
        return results + [_outcome.outcome_result(_RankOutcome(self._rank, FILESYSTEM, why, code))]

    def _finish_files(self, metadata: Metadata, results: List[List[WriteResult]],
                      first: _RankOutcome) -> SaveResult:
        assert self.checkpoint_id is not None and self.fallback_dir is not None
        assert self._fs is not None
        try:
            self._fs.finish(metadata, results)
        except Exception as exc:
            if not _outcome.is_node_failure(exc) or self.on_error == "raise":
                raise
            return SaveResult(self.checkpoint_id, SKIPPED,
                              why=f"its .metadata could not be written ({exc})",
                              code=_outcome.code_of(exc))
        self.last_deleted = _store.retain_filesystem(
            self.fallback_dir, self.job_id, self.keep_last_files, self.checkpoint_id)
        return SaveResult(self.checkpoint_id, FILESYSTEM,
                          os.path.join(self.fallback_dir, self.checkpoint_id), first.why, first.code)

    def _remove_partial_files(self) -> None:
        """A fallback dir this save left without .metadata (a rank's files
        written, the save skipped): never loadable, so removed."""
        if self.fallback_dir is None or self.checkpoint_id is None:
            return
        try:
            with _trusted_files.open_fallback_dir(self.fallback_dir) as root:
                if root.contains(self.checkpoint_id, _store.MARKER_NAME) and not root.contains(
                        self.checkpoint_id, _store.METADATA_NAME):
                    root.remove_checkpoint(self.checkpoint_id)
        except (FileNotFoundError, NotADirectoryError):
            pass  # nothing was written there
        except (OSError, _trusted_files.Untrusted) as exc:
            logs.log(logging.WARNING, f"checkpoint {self.checkpoint_id!r}: its partial files in "
                     f"{self.fallback_dir} stay ({exc})", errors.StatusCode.INTERNAL)
