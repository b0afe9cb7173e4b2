"""memoffloadd.service run by a real systemd: a container boots systemd
(podman --systemd=always) with memoffload installed as docs/deploy.md says
(the `cmake --install` tree of the Dockerfile's build stage, prefix /usr,
then systemd-sysusers). The shipped unit is used as installed; the test adds
only a drop-in with a short WatchdogSec= and edits the config file as an
operator would (small arena, a free metrics port).

The container is privileged: systemd needs to mount and make namespaces to
apply the unit's sandbox (ProtectSystem=, ProtectProc=, PrivateTmp=, ...), as
it can on a real host."""

import re
import time

import pytest

import container_common as cc
import deploy_common as dc

pytestmark = pytest.mark.container

CONFIG = "/etc/memoffload/memoffloadd.toml"
RUNTIME_DIR = "/run/memoffload"
WATCHDOG_S = 2
TRAINER_IN_GROUP = "alice"
TRAINER_OUTSIDE = "carol"
# Journal lines of systemd that mean a unit setting was not applied.
REJECTED_SETTING = re.compile(
    r"Failed to|Unknown (key|lvalue|section)|[Ii]gnoring|[Ii]nvalid|not supported|"
    r"status=2\d\d/")


class Machine:
    """A booted systemd container and shortcuts for what the tests ask it."""

    def __init__(self, podman: cc.Podman, name: str):
        self.podman = podman
        self.name = name

    def sh(self, script: str, timeout_s: float = 60, check: bool = True, user: str | None = None):
        return self.podman.exec(self.name, "sh", "-c", script, timeout_s=timeout_s, check=check,
                                user=user)

    def show(self, *properties: str) -> dict[str, str]:
        out = self.sh("systemctl show memoffloadd " + " ".join(f"-p {p}" for p in properties))
        return dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)

    def journal(self) -> str:
        return self.sh("journalctl -b -u memoffloadd --no-pager -o short-monotonic",
                       check=False).stdout

    def ctl(self, *args: str, user: str | None = None, check: bool = True):
        command = " ".join(["memoffloadctl", "--runtime-dir", RUNTIME_DIR, *args])
        return self.sh(command, user=user, check=check)


@pytest.fixture(scope="module")
def machine(podman, systemd_image):
    name = f"{cc.RUN_PREFIX}-systemd"
    podman.run("run", "-d", "--name", name, "--systemd=always", "--privileged",
               "--network=host", systemd_image)
    box = Machine(podman, name)
    try:
        state = cc.wait_for(
            "systemd to finish booting",
            lambda: box.sh("systemctl is-system-running", check=False).stdout.strip()
            in ("running", "degraded") and box.sh("systemctl is-system-running",
                                                  check=False).stdout.strip(), timeout_s=120)
        if state == "degraded":
            print(box.sh("systemctl --failed --no-pager", check=False).stdout)
        _configure(box)
        yield box
    finally:
        print(box.journal()[-4000:])
        podman.remove_container(name)


def _configure(box: Machine) -> None:
    """What an operator does before the first start (docs/deploy.md)."""
    box.metrics_port = cc.free_tcp_port()
    box.sh(f"sed -i -e 's/^metrics_address = .*/metrics_address = \"127.0.0.1:{box.metrics_port}\"/'"
           " -e 's/^size = .*/size = \"64MiB\"/' -e 's/^chunk_size = .*/chunk_size = \"16MiB\"/'"
           f" {CONFIG}")
    box.sh("mkdir -p /etc/systemd/system/memoffloadd.service.d && printf "
           f"'[Service]\\nWatchdogSec={WATCHDOG_S}s\\n' "
           "> /etc/systemd/system/memoffloadd.service.d/watchdog.conf && systemctl daemon-reload")
    # The replication key as docs/deploy.md gives it: a root file, 0400, and
    # a drop-in with LoadCredential= (the daemon finds it without a setting).
    # systemd 252 fills a unit's credentials in a mount namespace of its own
    # and moves the mount out; on a host / is shared (systemd makes it so at
    # boot), in a container systemd leaves propagation to the container
    # manager and podman's is private: the unit would see an empty directory.
    box.sh("mount --make-rshared /")
    box.sh("echo \"k1 $(od -An -tx1 -N32 /dev/urandom | tr -d ' \\n')\" > /tmp/replication-key && "
           "install -D -m 0400 -o root -g root /tmp/replication-key "
           "/etc/memoffload/replication-key && printf "
           "'[Service]\\nLoadCredential=replication-key:/etc/memoffload/replication-key\\n' "
           "> /etc/systemd/system/memoffloadd.service.d/replication-key.conf && "
           "systemctl daemon-reload")
    box.sh(f"useradd -m {TRAINER_IN_GROUP} && usermod -aG memoffload {TRAINER_IN_GROUP} && "
           f"useradd -m {TRAINER_OUTSIDE}")
    for tool in ("offload_worker", "region_loop"):
        worker = dc.bin_dir() / tool
        if not worker.is_file():
            pytest.fail(f"{worker} not built: scripts/build.sh builds {tool}")
        box.podman.run("cp", str(worker), f"{box.name}:/usr/local/bin/{tool}")


def test_unit_is_installed_where_the_docs_say(machine):
    machine.sh("test -x /usr/sbin/memoffloadd && test -x /usr/bin/memoffloadctl && "
               "test -f /usr/lib/systemd/system/memoffloadd.service && "
               f"test -f /usr/lib/sysusers.d/memoffload.conf && test -f {CONFIG}")
    assert machine.sh("getent passwd memoffload").stdout.startswith("memoffload:")
    # Debian 12's /lib is a link to usr/lib, and systemd names it by /lib.
    fragment = machine.show("FragmentPath")["FragmentPath"]
    assert machine.sh(f"readlink -f {fragment}").stdout.strip() == \
        "/usr/lib/systemd/system/memoffloadd.service"


def test_start_returns_active_after_ready(machine):
    start = time.monotonic()
    machine.sh("systemctl start memoffloadd", timeout_s=180)
    print(f"systemctl start took {time.monotonic() - start:.1f} s")
    print(machine.sh("systemctl status memoffloadd --no-pager -n 0", check=False).stdout)
    state = machine.show("ActiveState", "SubState", "Type", "StatusText", "MainPID")
    assert (state["ActiveState"], state["SubState"], state["Type"]) == \
        ("active", "running", "notify"), state
    # STATUS= comes from the daemon's sd_notify, sent with READY=1.
    assert "arena" in state["StatusText"], state
    assert "arena ready" in machine.journal()
    # The credential of the drop-in, read from systemd's copy of it.
    assert re.search(r"replication keys: k1 from /run/credentials/memoffloadd\.service/"
                     r"replication-key", machine.journal()), machine.journal()[-3000:]
    assert re.search(rf"^runtime dir\s+{RUNTIME_DIR}$", machine.ctl("status").stdout, re.M)


def test_hardening_is_applied_without_complaint(machine):
    journal = machine.journal()
    rejected = [line for line in journal.splitlines() if REJECTED_SETTING.search(line)]
    assert not rejected, "\n".join(rejected)
    pid = machine.show("MainPID")["MainPID"]
    status = machine.sh(f"cat /proc/{pid}/status").stdout
    assert re.search(r"^NoNewPrivs:\s+1$", status, re.M), status
    assert re.search(r"^Seccomp:\s+2$", status, re.M), status
    assert re.search(r"^Uid:\s+(\d+)", status, re.M).group(1) == \
        machine.sh("id -u memoffload").stdout.strip()
    # The daemon's own mount namespace: /proc with hidepid, / read-only.
    mounts = machine.sh(f"cat /proc/{pid}/mountinfo").stdout
    assert re.search(r" /proc .*hidepid=invisible", mounts), mounts
    assert re.search(r"^\S+ \S+ \S+ \S+ /usr ro,", mounts, re.M) or \
        re.search(r"^\S+ \S+ \S+ \S+ / ro,", mounts, re.M), mounts
    limits = machine.sh(f"cat /proc/{pid}/limits").stdout
    print(limits)


def test_watchdog_is_fed(machine):
    before = machine.show("WatchdogUSec", "WatchdogTimestampMonotonic", "MainPID", "NRestarts")
    assert before["WatchdogUSec"] == f"{WATCHDOG_S}s", before
    stamps = {before["WatchdogTimestampMonotonic"]}
    deadline = time.monotonic() + 4 * WATCHDOG_S
    while time.monotonic() < deadline:
        time.sleep(WATCHDOG_S / 4)
        stamps.add(machine.show("WatchdogTimestampMonotonic")["WatchdogTimestampMonotonic"])
    after = machine.show("ActiveState", "MainPID", "NRestarts")
    # Four periods later the same process still runs and fed it several times.
    assert after["ActiveState"] == "active"
    assert (after["MainPID"], after["NRestarts"]) == (before["MainPID"], before["NRestarts"])
    assert len(stamps) >= 4, stamps
    print(before, after, sorted(stamps), sep="\n")


def test_reload_applies_a_quota_change(machine):
    assert re.search(r"session_max_bytes = 0\b", machine.ctl("config").stdout)
    machine.sh(f"sed -i 's/^session_max_bytes = .*/session_max_bytes = \"8MiB\"/' {CONFIG}")
    machine.sh("systemctl reload memoffloadd")
    cc.wait_for("'config reloaded' in the journal",
                lambda: f"config reloaded from {CONFIG}" in machine.journal(), timeout_s=30)
    config = machine.ctl("config").stdout
    assert re.search(r"session_max_bytes = (8388608|\"8 ?MiB\")", config), config
    assert machine.show("ActiveState")["ActiveState"] == "active"
    print("\n".join(line for line in machine.journal().splitlines()
                    if "eload" in line or "config " in line))


def _verify_as(machine: Machine, *setpriv: str):
    """offload_worker verify (offload, prefetch, compare every byte) run
    through setpriv with the given credentials."""
    return machine.sh(" ".join(["setpriv", *setpriv, "offload_worker", "verify", RUNTIME_DIR,
                                "5", "10", "4096", "1048576"]), check=False)


def test_user_outside_the_socket_group_is_refused(machine):
    """carol is not in group memoffload: the 0750 runtime dir keeps her out."""
    carol = _verify_as(machine, "--reuid", TRAINER_OUTSIDE, "--regid", TRAINER_OUTSIDE,
                       "--init-groups")
    assert carol.returncode != 0
    assert "Permission denied" in carol.stderr, carol.stderr


def test_user_in_the_socket_group_attaches(machine):
    """alice joined group memoffload with usermod -aG, as docs/deploy.md says:
    the socket group's members attach by a supplementary gid, with the shipped
    config (empty access lists)."""
    alice = _verify_as(machine, "--reuid", TRAINER_IN_GROUP, "--regid", TRAINER_IN_GROUP,
                       "--init-groups")
    assert alice.returncode == 0, alice.stderr
    assert "verified 10 groups" in alice.stdout, alice.stdout


AS_ALICE = f"setpriv --reuid {TRAINER_IN_GROUP} --regid {TRAINER_IN_GROUP} --init-groups"


def _kept_regions(machine: Machine) -> set[str]:
    """The job's regions, each read back and compared (region_loop check)."""
    out = machine.sh(f"{AS_ALICE} region_loop check {RUNTIME_DIR} job", check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    names = out.stdout.split()
    assert names[-2] == "checked", out.stdout
    return set(names[:-2])


def test_a_crash_during_commits_keeps_every_answered_commit(machine):
    """SIGKILL while two ranks commit regions: Restart=on-failure starts the
    daemon again, which takes the arena back from systemd's fd store."""
    before = machine.show("MainPID", "NRestarts")
    # Each rank a transient unit of alice's (a process started by podman exec
    # would end with the exec).
    for i in range(2):
        machine.sh(f"systemd-run --unit=rank{i} --uid={TRAINER_IN_GROUP} "
                   f"--gid={TRAINER_IN_GROUP} -p SupplementaryGroups=memoffload "
                   f"sh -c 'exec region_loop loop {RUNTIME_DIR} job w{i} > /tmp/w{i}.log 2> /tmp/w{i}.err'")
    cc.wait_for("both ranks to commit 40 regions", lambda: all(
        int(machine.sh(f"wc -l < /tmp/w{i}.log", check=False).stdout or 0) >= 40
        for i in range(2)), timeout_s=60)
    for i in range(2):
        assert machine.sh(f"systemctl is-active rank{i}", check=False).stdout.strip() == \
            "active", machine.sh(f"tail -n 3 /tmp/w{i}.log").stdout
    machine.sh("systemctl kill -s KILL memoffloadd")
    cc.wait_for("the ranks to stop", lambda: all(
        "stopped" in machine.sh(f"tail -n 1 /tmp/w{i}.log").stdout for i in range(2)),
        timeout_s=60)  # stdout only: the client's log lines go to /tmp/w*.err
    cc.wait_for("the restarted daemon", lambda: machine.show(
        "ActiveState", "MainPID")["MainPID"] not in ("0", before["MainPID"]) and
        machine.show("ActiveState")["ActiveState"] == "active", timeout_s=60)
    after = machine.show("NRestarts")
    assert int(after["NRestarts"]) == int(before["NRestarts"]) + 1, (before, after)
    answered, maybe_gone = set(), set()
    for i in range(2):
        lines = machine.sh(f"cat /tmp/w{i}.log").stdout.splitlines()
        # Stopped by the kill, not by anything before it.
        assert "UNAVAILABLE" in lines[-1] or "NOT_FOUND" in lines[-1], lines[-3:]
        answered |= {n for n in lines if n.startswith("w")}
        maybe_gone |= {n.split()[1] for n in lines if n.startswith("deleting ")}
    kept = _kept_regions(machine)
    assert answered - maybe_gone <= kept, sorted(answered - maybe_gone - kept)[:5]
    assert len(kept - answered) <= 2, sorted(kept - answered)
    journal = machine.journal()
    assert re.search(rf"recovered the node from systemd's fd store: {len(kept)} of {len(kept)} "
                     "checkpoint regions", journal), journal[-3000:]
    machine.kept = kept


def test_a_restart_keeps_them(machine):
    """`systemctl restart` while a rank commits regions: the SIGTERM's
    snapshot (its session too) is read by the next start, and the rank's
    session resumes there: it goes on committing, never refused."""
    machine.sh(f"systemd-run --unit=rank-r --uid={TRAINER_IN_GROUP} --gid={TRAINER_IN_GROUP} "
               "-p SupplementaryGroups=memoffload "
               f"sh -c 'exec region_loop loop {RUNTIME_DIR} job-r r > /tmp/r.log 2> /tmp/r.err'")

    def committed() -> int:
        return int(machine.sh("grep -c '^r' /tmp/r.log", check=False).stdout or 0)

    cc.wait_for("the rank to commit 10 regions", lambda: committed() >= 10, timeout_s=60)
    machine.sh("systemctl restart memoffloadd", timeout_s=120)
    at_restart = committed()
    cc.wait_for("the rank to commit 10 more after the restart",
                lambda: committed() >= at_restart + 10, timeout_s=60)
    log = machine.sh("cat /tmp/r.log /tmp/r.err").stdout
    assert "stopped" not in log, log[-2000:]
    machine.sh("systemctl stop rank-r")
    assert _kept_regions(machine) == machine.kept
    journal = machine.journal()
    for line in ("received SIGTERM: keeping 1 session", "and 1 session for the next start",
                 "restart: 1 of 1 sessions handed on",
                 "no handed session waits any more: 1 resumed, 0 closed unresumed"):
        assert line in journal, journal[-3000:]
    assert "(0 journal records after the snapshot)" in journal, journal[-3000:]


def test_stop_drains_and_exits_zero(machine):
    """`systemctl stop` with a rank attached: systemd's job is a stop, not a
    restart, so the daemon drains and ends the session (the fd store goes
    with the stop) instead of keeping it."""
    machine.sh(f"systemd-run --unit=rank-s --uid={TRAINER_IN_GROUP} --gid={TRAINER_IN_GROUP} "
               "-p SupplementaryGroups=memoffload "
               f"sh -c 'exec region_loop loop {RUNTIME_DIR} job-s s > /tmp/s.log 2> /tmp/s.err'")
    cc.wait_for("the rank to commit", lambda: int(
        machine.sh("grep -c '^s' /tmp/s.log", check=False).stdout or 0) >= 3, timeout_s=60)
    machine.sh("systemctl stop memoffloadd", timeout_s=90)
    state = machine.show("ActiveState", "Result", "ExecMainStatus")
    assert state == {"ActiveState": "inactive", "Result": "success", "ExecMainStatus": "0"}, \
        state
    journal = machine.journal()
    for line in ("systemd runs a 'stop' job on the unit, not a restart: draining",
                 "received SIGTERM: draining (1 sessions", "drained: no groups held",
                 "stopped cleanly", "memoffloadd.service: Deactivated successfully"):
        assert line in journal, journal[-3000:]
    assert journal.count("received SIGTERM: keeping") == 1, journal[-3000:]  # the restart's
    cc.wait_for("the rank to stop", lambda: "stopped" in machine.sh(
        "tail -n 1 /tmp/s.log", check=False).stdout, timeout_s=60)
    print(state, journal[-1500:], sep="\n")


def test_a_full_stop_releases_the_store(machine):
    """systemd 252 has no FileDescriptorStorePreserve=: after a stop, the
    next start begins empty (docs/deploy.md says so)."""
    machine.sh("systemctl start memoffloadd", timeout_s=120)
    assert _kept_regions(machine) == set()
    assert "systemd's fd store: nothing kept, starting empty" in machine.journal()
    machine.sh("systemctl stop memoffloadd", timeout_s=90)
