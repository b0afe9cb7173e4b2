"""The arena on huge pages where the node allows them (issue 43), against
the real daemon: the page size it reports (start-up line, ``memoffloadctl
status``, ``/metrics``) is the one the kernel gave, read back here from the
daemon's and this process's own ``/proc/PID/smaps``; a node that refuses
falls back to 4 KiB pages with one line naming the setting.

The kernel setting (shared-memory THP, ``shmem_enabled``) is set for each
test and restored after it (bench/sysknobs.py); these tests need root and a
kernel with the setting, and say so when skipped.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Dict

import pytest

from conftest import Daemon, bin_dir
from memoffload import _C

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import sysknobs  # noqa: E402

MIB = 1 << 20
ARENA = 64 * MIB

pytestmark = pytest.mark.skipif(
    not (sysknobs.writable(sysknobs.THP) and sysknobs.writable(sysknobs.THP_2M)),
    reason=f"needs root and a kernel with {sysknobs.THP} and {sysknobs.THP_2M}")


def chunk_pages(pid: str) -> Dict[str, int]:
    """Summed smaps fields of the arena chunks a process maps."""
    out = {"Size": 0, "ShmemPmdMapped": 0, "Rss": 0}
    inside = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            first = line.split(None, 1)[0]
            if "-" in first and not first.endswith(":"):
                inside = "memfd:memoffload-chunk-" in line
            elif inside and first[:-1] in out:
                out[first[:-1]] += int(line.split()[1]) * 1024
    return out


def start(tmp_path, name: str) -> Daemon:
    rt = tmp_path / name
    rt.mkdir(mode=0o700)
    return Daemon(rt, "64MiB", "16MiB", ["--log-level=info", "--metrics-address=127.0.0.1:0"]
                  ).start()


def metric(d: Daemon, pages: str) -> float:
    body = urllib.request.urlopen(f"http://{ctl_status(d)['metrics_address']}/metrics",
                                  timeout=10).read().decode()
    key = f'memoffload_arena_page_bytes{{pages="{pages}"}}'
    (line,) = [x for x in body.splitlines() if x.startswith(key)]
    return float(line.split()[-1])


def ctl_status(d: Daemon) -> dict:
    out = subprocess.run([str(bin_dir() / "memoffloadctl"), "--runtime-dir", d.runtime_dir,
                          "--json", "status"], check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def test_with_shmem_thp_advised_the_arena_is_on_2mib_pages(tmp_path):
    with sysknobs.changed({sysknobs.THP: "advise", sysknobs.THP_2M: "inherit"}):
        d = start(tmp_path, "thp")
        try:
            check_thp(d)
        finally:
            d.stop()


def check_thp(d: Daemon) -> None:
    # What the daemon reports is what the kernel maps its chunks with.
    kernel = chunk_pages(str(d.proc.pid))
    assert kernel["Size"] == ARENA, kernel
    s = d.status()
    assert s["thp_bytes"] == kernel["ShmemPmdMapped"] == ARENA, (s, kernel)
    assert s["hugetlb_bytes"] == 0 and s["pages"] == "2 MiB pages (shared-memory THP)", s
    assert ctl_status(d)["pages"] == s["pages"]
    assert metric(d, "thp") == ARENA and metric(d, "base") == 0
    log = d.log.read_text()
    assert "on 2 MiB pages (shared-memory THP)" in log, log
    assert "not all on huge pages" not in log, log
    # A client maps them with one page-table entry per 2 MiB too (its
    # mapping is aligned and advised).
    store = _C.HostStateStore(runtime_dir=d.runtime_dir, job_id="thp")
    block = store.empty(8 * MIB)
    block.fill_(7)
    mine = chunk_pages("self")
    assert mine["ShmemPmdMapped"] >= 8 * MIB, mine
    del block, store


def test_a_restart_tells_its_kept_chunks_pages_once_they_are_mapped(tmp_path):
    """A restart maps the chunks it kept after it serves: the start-up line
    does not guess their pages, and once they are mapped every report says
    2 MiB pages again, as the kernel maps them."""
    import keeper_wire as kw
    from test_takeover import wait_for_log

    with sysknobs.changed({sysknobs.THP: "advise", sysknobs.THP_2M: "inherit"}):
        rt = tmp_path / "kept"
        rt.mkdir(mode=0o700)
        keeper = kw.start_keeper(str(rt), tmp_path / "keeper.log")
        args = ["--log-level=info", "--metrics-address=127.0.0.1:0"]
        d2 = None
        try:
            d = Daemon(rt, "64MiB", "16MiB", args).start()
            d.stop()
            d2 = Daemon(rt, "64MiB", "16MiB", args).start()
            wait_for_log(d2, f"memoffloadd[{d2.proc.pid}] INFO kept chunks mapped: 4 (64.00 MiB)"
                             " in ")
            log = d2.log.read_text()
            assert f"memoffloadd[{d2.proc.pid}] INFO arena ready: 64.00 MiB, 4 chunks of 16.00 " \
                "MiB, on pages told once its kept chunks are mapped" in log, log
            assert "64.00 MiB of them on 2 MiB pages" in log, log
            check_thp(d2)
        finally:
            if d2 is not None:
                d2.stop()
            keeper.terminate()
            keeper.wait(timeout=10)


@pytest.mark.parametrize("global_setting,size_setting,named", [
    ("never", "inherit", f"{sysknobs.THP} is 'never'"),
    ("deny", "inherit", f"{sysknobs.THP} is 'deny'"),
    ("advise", "never", f"{sysknobs.THP_2M} is 'never'"),
])
def test_a_node_that_refuses_falls_back_with_one_line(tmp_path, global_setting, size_setting,
                                                      named):
    with sysknobs.changed({sysknobs.THP: global_setting, sysknobs.THP_2M: size_setting}):
        d = start(tmp_path, "refused")
    try:
        kernel = chunk_pages(str(d.proc.pid))
        s = d.status()
        assert s["thp_bytes"] == kernel["ShmemPmdMapped"] == 0, (s, kernel)
        assert s["pages"] == "4.00 KiB pages", s
        assert metric(d, "thp") == 0 and metric(d, "base") == ARENA
        lines = [x for x in d.log.read_text().splitlines() if "huge pages" in x]
        assert len(lines) == 1, lines
        assert named in lines[0] and "'advise'" in lines[0] and "docs/deploy.md" in lines[0], lines
    finally:
        d.stop()


def test_the_setting_is_restored_even_after_a_killed_run(tmp_path):
    """A run killed between its change and its restore (the state file
    left behind) is undone by the next one."""
    before = sysknobs.read(sysknobs.THP)
    script = (f"import sys, os; sys.path.insert(0, {str(Path(sysknobs.__file__).parent)!r}); "
              "import sysknobs\n"
              "with sysknobs.changed({sysknobs.THP: 'advise' if sysknobs.read(sysknobs.THP) != "
              "'advise' else 'never'}):\n"
              "    print('changed', flush=True); os.kill(os.getpid(), 9)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == -9 and "changed" in proc.stdout, proc
    assert sysknobs.read(sysknobs.THP) != before
    assert Path(sysknobs.STATE).exists()
    assert sysknobs.restore_leftovers() == [f"{sysknobs.THP}: {before}"]
    assert sysknobs.read(sysknobs.THP) == before
    assert not Path(sysknobs.STATE).exists()
    # And a SIGTERM unwinds through the restore.
    script = script.replace("os.kill(os.getpid(), 9)", "os.kill(os.getpid(), 15)")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 143 and sysknobs.read(sysknobs.THP) == before, proc
    assert not Path(sysknobs.STATE).exists()


def test_a_live_run_s_setting_is_left_to_it():
    """Another run's restore_leftovers gives back only what dead runs left:
    a bench still running keeps its setting (and a nested change keeps the
    first value as the one a crash is undone to)."""
    before = sysknobs.read(sysknobs.THP)
    other = "advise" if before != "advise" else "never"
    script = (f"import sys; sys.path.insert(0, {str(Path(sysknobs.__file__).parent)!r}); "
              "import sysknobs\n"
              f"with sysknobs.changed({{sysknobs.THP: {other!r}}}):\n"
              "    print('changed', flush=True); sys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "changed"
        assert sysknobs.restore_leftovers() == []
        assert sysknobs.read(sysknobs.THP) == other
        with sysknobs.changed({sysknobs.THP: before}):
            assert sysknobs.read(sysknobs.THP) == before
        assert sysknobs.read(sysknobs.THP) == other
        proc.kill()
        proc.wait()
        assert sysknobs.restore_leftovers() == [f"{sysknobs.THP}: {before}"]
        assert sysknobs.read(sysknobs.THP) == before
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sysknobs.restore_leftovers()
