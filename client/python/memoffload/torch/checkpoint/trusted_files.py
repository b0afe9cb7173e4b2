"""Which checkpoint files of the filesystem fallback may be trusted, and the
only way they are opened.

A fallback checkpoint's ``.metadata`` is a pickle: loading one that another
user wrote runs their code as you. Only what you own and nobody else can
write is read (docs/checkpoints.md, "Whose files are read"):

- the fallback dir is reached one component at a time from ``/``
  (:func:`open_fallback_dir`): every directory on the way is root's or
  yours and not writable by group or others unless sticky (like /tmp), and
  every symlink on the way is root's or yours, so nobody else can change
  where the path leads; the fallback dir itself is yours and not writable
  by group or others;
- everything below it is opened through the fallback dir's open descriptor
  (``openat`` with ``O_NOFOLLOW``), never by path again, and checked with
  ``fstat`` on what was opened: each checkpoint dir and file is yours, not
  writable by group or others, and not a symlink. DCP's FileSystemReader and
  FileSystemWriter are handed :class:`TrustedFileSystem`, which opens their
  files that way (issue 38: flipping a symlink between the check and DCP's
  own open of the path ran another user's pickle).

What fails is refused with :class:`PermissionDenied`, or skipped with one
warning by ``latest_checkpoint``.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import io
import logging
import os
import stat
import threading
import weakref
from pathlib import Path
from typing import Iterable, Iterator, Optional, Set, Tuple

from torch.distributed.checkpoint.filesystem import FileSystemBase

from ... import errors, logs

_warned: Set[str] = set()
_warned_lock = threading.Lock()

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Directories on the way are only passed through: search permission is enough.
_PASS = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_LINKS = 40


class Untrusted(Exception):
    """What another user could have written, and why (the message)."""


def _owner_problem(path: str, st: os.stat_result, what: str) -> Optional[str]:
    me = os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        return f"{what} {path} is a symlink"
    if st.st_uid != me:
        return f"{what} {path} belongs to uid {st.st_uid}, not to you (uid {me})"
    if st.st_mode & 0o022:
        return (f"{what} {path} has mode {stat.S_IMODE(st.st_mode):04o}: its group or others "
                f"can write it (chmod go-w {path})")
    return None


def _passed_problem(here: str, shown: str, st: os.stat_result) -> Optional[str]:
    """Why directory ``here``, on the way to ``shown``, lets someone else
    change what is below it, or None."""
    me = os.geteuid()
    if st.st_uid not in (0, me):
        return (f"directory {here} on the way to {shown} belongs to uid {st.st_uid}, who could "
                f"replace what is below it")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return (f"directory {here} on the way to {shown} has mode {stat.S_IMODE(st.st_mode):04o}: "
                f"its group or others could replace what is below it")
    return None


def _walk(shown: str, create: bool) -> Tuple[int, str]:
    """An O_RDONLY descriptor of directory ``shown`` and its path without
    symlinks, reached as the module docstring says (``create``: missing
    directories are made 0700 on the way). Raises Untrusted,
    FileNotFoundError or NotADirectoryError."""
    try:
        return _walk_from_root(shown, create)
    except PermissionError as exc:  # a directory on the way we may not search
        raise PermissionError(exc.errno, f"{exc.strerror} on the way to {shown}",
                              exc.filename) from None


def _walk_from_root(shown: str, create: bool) -> Tuple[int, str]:
    path = shown if shown.startswith("/") else os.path.join(os.getcwd(), shown)
    stack = [os.open("/", _PASS)]
    names = []
    try:
        problem = _passed_problem("/", shown, os.fstat(stack[0]))
        if problem is not None:
            raise Untrusted(problem)
        pending = collections.deque(path.split("/"))
        links = 0
        while pending:
            name = pending.popleft()
            if name in ("", "."):
                continue
            if name == "..":
                if len(stack) > 1:
                    os.close(stack.pop())
                    names.pop()
                continue
            here = "/" + "/".join(names + [name])
            try:
                st = os.stat(name, dir_fd=stack[-1], follow_symlinks=False)
            except FileNotFoundError:
                if not create:
                    raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), here) from None
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o700, dir_fd=stack[-1])
                st = os.stat(name, dir_fd=stack[-1], follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                links += 1
                if links > _MAX_LINKS:
                    raise Untrusted(f"{shown} passes through more than {_MAX_LINKS} symlinks")
                if st.st_uid not in (0, os.geteuid()):
                    raise Untrusted(f"symlink {here} on the way to {shown} belongs to uid "
                                    f"{st.st_uid}, who could change where it leads")
                target = os.readlink(name, dir_fd=stack[-1])
                if target.startswith("/"):
                    while len(stack) > 1:
                        os.close(stack.pop())
                    names.clear()
                pending.extendleft(reversed(target.split("/")))
                continue
            if not stat.S_ISDIR(st.st_mode):
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), here)
            last = all(rest in ("", ".") for rest in pending)
            fd = os.open(name, _DIR if last else _PASS, dir_fd=stack[-1])
            stack.append(fd)
            names.append(name)
            if not last:
                problem = _passed_problem(here, shown, os.fstat(fd))
                if problem is not None:
                    raise Untrusted(problem)
        if len(stack) == 1:
            raise Untrusted(f"{shown} is /")
        return stack.pop(), "/" + "/".join(names)
    finally:
        for fd in stack:
            os.close(fd)


class TrustedDir:
    """An open fallback dir that passed the rules above; what is below it is
    opened through ``fd``. Closed by :meth:`close` or when collected."""

    def __init__(self, path: str, fd: int, resolved: str) -> None:
        self.path = path          # as given (what messages name)
        self.resolved = resolved  # without symlinks
        self.fd = fd
        self._finalizer = weakref.finalize(self, os.close, fd)

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> "TrustedDir":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open_checkpoint(self, name: str, check_files: bool = False) -> int:
        """A descriptor of checkpoint dir ``name`` (the caller closes it),
        after its owner and mode (and, with ``check_files``, every entry's)
        were checked. Raises Untrusted or FileNotFoundError."""
        _one_component(name)
        where = os.path.join(self.path, name)
        try:
            fd = os.open(name, _DIR, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            link = stat.S_ISLNK(os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_mode)
            raise Untrusted(f"checkpoint dir {where} is "
                            + ("a symlink" if link else "not a directory")) from None
        try:
            problem = _owner_problem(where, os.fstat(fd), "checkpoint dir")
            if problem is None and check_files:
                for entry in sorted(os.listdir(fd)):
                    path = os.path.join(where, entry)
                    st = os.stat(entry, dir_fd=fd, follow_symlinks=False)
                    problem = _owner_problem(path, st, "checkpoint file")
                    if problem is None and not stat.S_ISREG(st.st_mode):
                        problem = f"checkpoint file {path} is not a regular file"
                    if problem is not None:
                        break
            if problem is not None:
                raise Untrusted(problem)
            return fd
        except BaseException:
            os.close(fd)
            raise

    def open_file(self, ckpt_fd: int, name: str, where: str, write: bool = False) -> int:
        """Opens file ``name`` of a checkpoint dir's descriptor, never
        through a symlink, and checks what was opened (``where`` names it)."""
        _one_component(name)
        if write:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600, dir_fd=ckpt_fd)
        else:  # O_NONBLOCK: a FIFO planted there would block the open (regular files ignore it)
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                         dir_fd=ckpt_fd)
        try:
            st = os.fstat(fd)
            problem = _owner_problem(where, st, "checkpoint file")
            if problem is None and not stat.S_ISREG(st.st_mode):
                problem = f"checkpoint file {where} is not a regular file"
            if problem is not None:
                raise Untrusted(problem)
            os.set_blocking(fd, True)
            return fd
        except BaseException:
            os.close(fd)
            raise

    def contains(self, ckpt: str, name: str) -> bool:
        """Whether checkpoint dir ``ckpt`` (not checked) has an entry
        ``name``, never following a symlink."""
        _one_component(ckpt)
        try:
            fd = os.open(ckpt, _DIR, dir_fd=self.fd)
        except OSError:
            return False
        try:
            os.stat(name, dir_fd=fd, follow_symlinks=False)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)

    def read(self, ckpt: str, name: str) -> bytes:
        """The contents of ``<ckpt>/<name>``, opened as :meth:`open_file` does."""
        ckpt_fd = self.open_checkpoint(ckpt)
        try:
            fd = self.open_file(ckpt_fd, name, os.path.join(self.path, ckpt, name))
        finally:
            os.close(ckpt_fd)
        with os.fdopen(fd, "rb") as f:
            return f.read()

    def remove_checkpoint(self, name: str) -> None:
        """Deletes checkpoint dir ``name`` and everything in it, through
        descriptors (a symlink in it is removed, never followed)."""
        _remove_tree(self.fd, name)


def _one_component(name: str) -> None:
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"{name!r} is not one path component")


def _remove_tree(parent_fd: int, name: str) -> None:
    fd = os.open(name, _DIR, dir_fd=parent_fd)
    try:
        for entry in os.listdir(fd):
            if stat.S_ISDIR(os.stat(entry, dir_fd=fd, follow_symlinks=False).st_mode):
                _remove_tree(fd, entry)
            else:
                os.unlink(entry, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent_fd)


def open_fallback_dir(fallback_dir: str, create: bool = False) -> TrustedDir:
    """The fallback dir, opened as the module docstring says (``create``:
    made 0700 with any missing parent). Raises Untrusted, or
    FileNotFoundError / NotADirectoryError when it is not there."""
    fd, resolved = _walk(fallback_dir, create)
    try:
        problem = _owner_problem(fallback_dir, os.fstat(fd), "checkpoint fallback dir")
        if problem is not None:
            raise Untrusted(problem)
    except BaseException:
        os.close(fd)
        raise
    return TrustedDir(fallback_dir, fd, resolved)


def refused(problem: object) -> errors.PermissionDenied:
    return errors.PermissionDenied(
        f"refusing checkpoint files another user could have written: {problem}. Nothing was read "
        "from it. Remove it if it is not yours, or use a fallback_dir / $MEMOFFLOAD_CHECKPOINT_DIR "
        "of your own that nobody else can write")


def trusted_fallback_dir(fallback_dir: str, create: bool = False) -> TrustedDir:
    """open_fallback_dir, with PermissionDenied for what may not be trusted."""
    try:
        return open_fallback_dir(fallback_dir, create)
    except Untrusted as exc:
        raise refused(exc) from None


class TrustedFileSystem(FileSystemBase):
    """DCP's file operations for one fallback dir, every one through its
    descriptor (TrustedDir): a path DCP names is ``<fallback dir>/<checkpoint
    id>[/<file>]`` and nothing else. Files read are checked as
    :meth:`TrustedDir.open_file` does; files and dirs made are 0600 / 0700."""

    def __init__(self, root: TrustedDir) -> None:
        self.root = root

    def _parts(self, path: "str | os.PathLike") -> Tuple[str, Optional[str]]:
        rel = os.path.relpath(os.fspath(path), self.root.path)
        parts = rel.split(os.sep)
        if len(parts) > 2 or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"{path} is not a checkpoint dir or file in {self.root.path}")
        return parts[0], (parts[1] if len(parts) == 2 else None)

    def _file(self, path: "str | os.PathLike") -> Tuple[str, str]:
        ckpt, name = self._parts(path)
        if name is None:
            raise ValueError(f"{path} is a checkpoint dir, not a file in one")
        return ckpt, name

    @contextlib.contextmanager
    def create_stream(self, path: "str | os.PathLike", mode: str) -> Iterator[io.IOBase]:
        if mode not in ("rb", "wb"):
            raise ValueError(f"mode {mode!r}: only 'rb' and 'wb'")
        ckpt, name = self._file(path)
        ckpt_fd = self._checkpoint(ckpt)
        try:
            fd = self.root.open_file(ckpt_fd, name, os.fspath(path), write=mode == "wb")
        except Untrusted as exc:
            raise refused(exc) from None
        finally:
            os.close(ckpt_fd)
        with os.fdopen(fd, mode) as stream:
            yield stream

    def _checkpoint(self, ckpt: str) -> int:
        try:
            return self.root.open_checkpoint(ckpt)
        except Untrusted as exc:
            raise refused(exc) from None

    def concat_path(self, path: "str | os.PathLike", suffix: str) -> "str | os.PathLike":
        return Path(path) / suffix

    def init_path(self, path: "str | os.PathLike") -> "str | os.PathLike":
        return Path(path)

    def rename(self, path: "str | os.PathLike", new_path: "str | os.PathLike") -> None:
        ckpt, name = self._file(path)
        new_ckpt, new_name = self._file(new_path)
        if new_ckpt != ckpt:
            raise ValueError(f"{path} -> {new_path}: a rename stays in its checkpoint dir")
        ckpt_fd = self._checkpoint(ckpt)
        try:
            os.rename(name, new_name, src_dir_fd=ckpt_fd, dst_dir_fd=ckpt_fd)
        finally:
            os.close(ckpt_fd)

    def mkdir(self, path: "str | os.PathLike") -> None:
        ckpt, name = self._parts(path)
        if name is not None:
            raise ValueError(f"{path}: only checkpoint dirs are made")
        with contextlib.suppress(FileExistsError):
            os.mkdir(ckpt, 0o700, dir_fd=self.root.fd)
        os.close(self._checkpoint(ckpt))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: "str | os.PathLike") -> bool:
        return True

    def exists(self, path: "str | os.PathLike") -> bool:
        ckpt, name = self._parts(path)
        if name is None:
            try:
                os.stat(ckpt, dir_fd=self.root.fd, follow_symlinks=False)
                return True
            except FileNotFoundError:
                return False
        return self.root.contains(ckpt, name)

    def rm_file(self, path: "str | os.PathLike") -> None:
        ckpt, name = self._file(path)
        ckpt_fd = self._checkpoint(ckpt)
        try:
            os.unlink(name, dir_fd=ckpt_fd)
        finally:
            os.close(ckpt_fd)


def warn_ignored(problems: Iterable[str]) -> None:
    """One warning (through the "memoffload" logger) naming what
    ``latest_checkpoint`` ignored and why; each problem is told once."""
    with _warned_lock:
        new = [p for p in problems if p not in _warned]
        _warned.update(new)
    if new:
        logs.log(logging.WARNING,
                 "latest_checkpoint ignores checkpoint files another user could have written: "
                 + "; ".join(new) + " (remove them if they are not yours)",
                 errors.StatusCode.PERMISSION_DENIED)
