"""A restart of the daemon keeps the node (docs/deploy.md, "Restarts keep the
node"): real `memoffloadd` processes beside a real `memoffloadd keeper`, the
store containers use (systemd's store is tested in
tests/deploy/test_systemd_boot.py). Regions committed before a SIGKILL or a
SIGTERM come back bit for bit, CRC-verified, with the node's instance id; a
damaged one is dropped and named; another uid cannot reach the keeper, and
a state of a newer format is refused without being released."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import pytest
import torch  # noqa: F401

from memoffload import _C

import keeper_wire as kw
from conftest import Daemon, bin_dir
from restart_writer import SIZE, content
from test_takeover import wait_for_log

HERE = Path(__file__).parent
NOBODY = 65534


@pytest.fixture
def node(tmp_path):
    """A runtime dir with a keeper in it; the daemons are the test's."""
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    keeper = kw.start_keeper(str(rt), tmp_path / "keeper.log")
    daemons: List[Daemon] = []

    def start(*extra: str) -> Daemon:
        d = Daemon(rt, "64MiB", "16MiB", ["--log-level=info", *extra]).start()
        daemons.append(d)
        return d

    yield rt, start, tmp_path / "keeper.log"
    for d in daemons:
        if d.proc is not None and d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()
    keeper.terminate()
    keeper.wait(timeout=10)


def regions(rt: Path, job: str) -> Dict[str, dict]:
    store = _C.RegionStore(runtime_dir=str(rt), job_id=job, rank=0)
    try:
        return {r["name"]: r for r in store.list("")}
    finally:
        store.close()


def read_back(rt: Path, job: str, names) -> None:
    """Each region reads back as written, its CRC32Cs checked as it is read."""
    store = _C.RegionStore(runtime_dir=str(rt), job_id=job, rank=0)
    try:
        for name in names:
            r = store.open(name, verify=True)
            assert r.read_bytes(0, SIZE - 7) == content(name), name
            r.close()
    finally:
        store.close()


def write(rt: Path, job: str, names, checksums: bool = True) -> None:
    store = _C.RegionStore(runtime_dir=str(rt), job_id=job, rank=0, checksums=checksums)
    try:
        for name in names:
            w = store.create(name, SIZE)
            w.append(content(name))
            w.commit()
    finally:
        store.close()


def status(rt: Path) -> dict:
    out = subprocess.run([str(bin_dir() / "memoffloadctl"), "--runtime-dir", str(rt), "--json",
                          "status"], check=True, capture_output=True, text=True, timeout=30)
    return json.loads(out.stdout)


def test_sigkill_during_concurrent_commits_keeps_every_answered_commit(node, tmp_path):
    rt, start, _ = node
    d = start("--regions-max-bytes=60MiB")
    instance = status(rt)["instance_id"]
    logs = [tmp_path / f"writer{i}.log" for i in range(3)]
    writers = [subprocess.Popen([sys.executable, str(HERE / "restart_writer.py"), str(rt), "job",
                                 f"w{i}", str(log)], cwd=HERE) for i, log in enumerate(logs)]
    # Let them commit for a while, then kill the daemon in the middle of it.
    deadline = time.monotonic() + 60
    while min(log.read_text().count("\n") if log.exists() else 0 for log in logs) < 50:
        assert time.monotonic() < deadline, "the writers did not get going"
        assert all(w.poll() is None for w in writers), [log.read_text() for log in logs]
        time.sleep(0.05)
    d.kill()
    for w in writers:
        assert w.wait(timeout=60) == 0
    answered, maybe_gone = set(), set()
    for log in logs:
        lines = log.read_text().splitlines()
        assert lines[-1].startswith("stopped"), lines[-3:]
        answered |= {n for n in lines if n.startswith("w")}
        maybe_gone |= {n.split()[1] for n in lines if n.startswith("deleting ")}
    expected = answered - maybe_gone
    assert len(expected) >= 40

    d2 = start("--regions-max-bytes=60MiB")
    kept = regions(rt, "job")
    assert expected <= set(kept), f"lost: {sorted(expected - set(kept))[:5]}"
    # Beyond those, at most the one commit each writer had in flight.
    assert len(set(kept) - answered) <= len(writers), sorted(set(kept) - answered)
    read_back(rt, "job", sorted(kept))
    assert status(rt)["instance_id"] == instance
    log = d2.log.read_text()
    assert f"recovered the node from the keeper at {rt}/keeper.sock: {len(kept)} of {len(kept)} " \
           "checkpoint regions" in log, log
    assert "0 dropped" in log


def test_sigterm_writes_a_snapshot_and_the_next_start_reads_it(node):
    rt, start, _ = node
    d = start()
    write(rt, "job", [f"s{i}" for i in range(5)])
    write(rt, "job", ["plain"], checksums=False)
    d.stop()
    assert d.proc.returncode == 0
    assert "state kept in the keeper" in d.log.read_text()
    d2 = start()
    kept = regions(rt, "job")
    assert set(kept) == {"s0", "s1", "s2", "s3", "s4", "plain"}
    read_back(rt, "job", [f"s{i}" for i in range(5)] + ["plain"])
    log = d2.log.read_text()
    assert "(0 journal records after the snapshot)" in log, log
    assert "1 unverified" in log and "region plain of job job (uid" in log, log
    # Deletes are kept too, and a third start sees the same.
    store = _C.RegionStore(runtime_dir=str(rt), job_id="job", rank=0)
    store.delete("s0")
    store.close()
    d2.kill()
    start()
    assert set(regions(rt, "job")) == {"s1", "s2", "s3", "s4", "plain"}


def test_a_damaged_region_is_dropped_and_named_the_others_kept(node):
    # tenant = job: the damaged region's job has a chunk of its own.
    rt, start, _ = node
    d = start("--tenant=job", "--regions-uid-max-bytes=0")
    write(rt, "job", ["good-a", "good-b"])
    write(rt, "other", ["bad"])
    d.kill()
    # Flip one byte of "bad" in its chunk, as a stray write would.
    import mmap

    held = kw.take(str(rt))
    bad_chunk = None
    try:
        needle = content("bad")[:4096]
        for name, fd in held.items():
            if not name.startswith("mo-chunk-"):
                continue
            with mmap.mmap(fd, os.fstat(fd).st_size) as m:
                at = m.find(needle)
                if at >= 0:
                    m[at + 100] ^= 0xFF
                    bad_chunk = (name, os.fstat(fd).st_ino, at)
        assert bad_chunk is not None
    finally:
        for fd in held.values():
            os.close(fd)
    d2 = start("--tenant=job", "--regions-uid-max-bytes=0")
    assert set(regions(rt, "job")) == {"good-a", "good-b"}
    assert regions(rt, "other") == {}
    read_back(rt, "job", ["good-a", "good-b"])
    log = d2.log.read_text()
    assert "dropped region bad of job other" in log and "fails its CRC32C" in log, log
    # Its chunk, left with no region, got a new memfd: what old processes may
    # still map (and the dropped bytes) is never handed to the next tenant.
    assert "kept chunk with no region left got new memfds" in log, log
    held = kw.take(str(rt))
    try:
        name, inode, at = bad_chunk
        assert os.fstat(held[name]).st_ino != inode
        with mmap.mmap(held[name], os.fstat(held[name]).st_size) as m:
            assert m[at:at + SIZE] == bytes(SIZE)
    finally:
        for fd in held.values():
            os.close(fd)


def test_another_uid_cannot_reach_the_keeper(tmp_path):
    # A runtime dir every uid can reach (pytest's tmp dirs are private), and
    # the socket opened to everyone: the keeper still checks the peer's uid
    # and answers nothing.
    rt = Path(tempfile.mkdtemp(prefix="mo-keeper-"))
    try:
        os.chmod(rt, 0o755)
        keeper = kw.start_keeper(str(rt), tmp_path / "keeper.log")
        try:
            os.chmod(rt / "keeper.sock", 0o666)
            assert kw.probe_as(NOBODY, rt / "keeper.sock", b'take') in ("b''", "closed")
            assert f"refused a connection from uid {NOBODY}" in (tmp_path / "keeper.log").read_text()
        finally:
            keeper.terminate()
            keeper.wait(timeout=10)
    finally:
        shutil.rmtree(rt, ignore_errors=True)


def test_a_keeper_socket_that_is_not_private_is_refused(node, tmp_path):
    rt, start, _ = node
    os.chmod(rt / "keeper.sock", 0o666)
    exe = bin_dir() / "memoffloadd"
    out = subprocess.run([str(exe), f"--runtime-dir={rt}", "--arena-size=64MiB",
                          "--chunk-size=16MiB", "--metrics-address=none",
                          "--state-store=keeper"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "refusing the keeper socket" in out.stderr and "mode 0600" in out.stderr, out.stderr


def test_a_state_of_a_newer_format_is_refused_and_not_released(node, tmp_path):
    rt, start, _ = node
    d = start()
    write(rt, "job", ["kept"])
    d.stop()
    # A snapshot a newer daemon wrote (version 3), numbered after the kept one.
    body = b"MOSNAPSH" + (3).to_bytes(4, "little") + b"\0" * 40
    fd = kw.sealed_memfd(body + b"\0\0\0\0")
    kw.put(str(rt), "mo-snapshot@999999", fd)
    os.close(fd)
    exe = bin_dir() / "memoffloadd"
    out = subprocess.run([str(exe), f"--runtime-dir={rt}", "--arena-size=64MiB",
                          "--chunk-size=16MiB", "--metrics-address=none"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "format v3 was written by a newer memoffloadd" in out.stderr + out.stdout, out
    assert "refusing to start so as not to drop it" in out.stderr, out.stderr
    held = kw.take(str(rt))
    try:
        assert "mo-snapshot@999999" in held and any(n.startswith("mo-chunk-") for n in held)
    finally:
        for f in held.values():
            os.close(f)


def test_without_a_store_a_restart_says_it_empties_the_node(tmp_path):
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    d = Daemon(rt, "64MiB", "16MiB", ["--log-level=info"]).start()
    try:
        assert "state store: none: a restart of the daemon empties the node" in d.log.read_text()
    finally:
        d.stop()
    # Asked for a keeper that is not there, the start fails and says so.
    out = subprocess.run([str(bin_dir() / "memoffloadd"), f"--runtime-dir={rt}",
                          "--state-store=keeper", "--arena-size=64MiB", "--chunk-size=16MiB",
                          "--metrics-address=none"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "no keeper at" in out.stderr, out.stderr


def chunk_inodes(rt: Path) -> Dict[str, int]:
    """Each kept chunk's memfd inode, by name: the same inode is the same memory."""
    held = kw.take(str(rt))
    try:
        return {n: os.fstat(fd).st_ino for n, fd in held.items() if n.startswith("mo-chunk-")}
    finally:
        for fd in held.values():
            os.close(fd)


def locked_chunk_bytes(pid: int) -> int:
    """The arena's pages a process has mapped and locked (smaps `Locked:`
    of its chunk mappings: present pages only, unlike VmLck)."""
    total, inside = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            first = line.split(None, 1)[0]
            if "-" in first and not first.endswith(":"):
                inside = "memfd:memoffload-chunk-" in line
            elif inside and first == "Locked:":
                total += int(line.split()[1]) * 1024
    return total


def two_jobs_one_gone(rt: Path) -> None:
    """tenant = job: job a's chunk keeps a region, job b's was handed out and
    holds none now, and the arena's two other chunks were never handed out."""
    write(rt, "a", ["kept"])
    write(rt, "b", ["gone"])
    store = _C.RegionStore(runtime_dir=str(rt), job_id="b", rank=0)
    store.delete("gone")
    store.close()


@pytest.mark.parametrize("stop", ["sigkill", "sigterm"])
def test_a_restart_keeps_the_memory_of_chunks_no_process_was_handed(node, stop):
    """A chunk no process ever mapped is kept as it is (no new pre-fault, no
    second copy while the store holds the old one); the chunk job b's process
    mapped gets new memory, since that process may still map the old."""
    rt, start, _ = node
    d = start("--tenant=job", "--regions-uid-max-bytes=0")
    two_jobs_one_gone(rt)
    before = chunk_inodes(rt)
    assert len(before) == 4
    d.kill() if stop == "sigkill" else d.stop()
    d2 = start("--tenant=job", "--regions-uid-max-bytes=0")
    after = chunk_inodes(rt)
    same = {n for n in before if after[n] == before[n]}
    # Job a's chunk (its region) and the two never handed out.
    assert len(same) == 3, (before, after)
    read_back(rt, "a", ["kept"])
    assert "mo-handed-chunks not used" not in d2.log.read_text()
    # Mapped after ready, and locked then as a new chunk is.
    assert "3 kept chunks (48.00 MiB) mapped after ready" in d2.log.read_text()
    wait_for_log(d2, f"memoffloadd[{d2.proc.pid}] INFO kept chunks mapped: 3 (48.00 MiB) in ")
    if "mlock yes" in d2.log.read_text():
        assert locked_chunk_bytes(d2.proc.pid) >= 64 << 20
    # The next start keeps them too: the record went on with the new daemon.
    d2.kill()
    start("--tenant=job", "--regions-uid-max-bytes=0")
    assert {n for n in before if chunk_inodes(rt)[n] == before[n]} == same


def test_a_record_of_handed_chunks_another_daemon_followed_is_not_believed(node):
    """The record is trusted only beside the journal its daemon wrote: one
    that an older daemon (which keeps no record) followed says nothing of
    what that daemon handed out, so every chunk with no region is renewed."""
    import mmap

    rt, start, _ = node
    d = start("--tenant=job", "--regions-uid-max-bytes=0")
    two_jobs_one_gone(rt)
    before = chunk_inodes(rt)
    d.kill()
    held = kw.take(str(rt))
    try:
        # As if written by another daemon than the newest journal's.
        with mmap.mmap(held["mo-handed-chunks"], 4096) as m:
            m[16] ^= 0xFF
    finally:
        for fd in held.values():
            os.close(fd)
    d2 = start("--tenant=job", "--regions-uid-max-bytes=0")
    after = chunk_inodes(rt)
    assert len({n for n in before if after[n] == before[n]}) == 1, (before, after)
    read_back(rt, "a", ["kept"])
    log = d2.log.read_text()
    assert "mo-handed-chunks not used (written by another daemon than the newest journal's)" \
        in log, log
