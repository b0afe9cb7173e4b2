"""Checks of deploy/systemd and cmake/install.cmake: the unit verifies, its
exposure score does not rise above the one recorded in docs/deploy.md, the
daemon stays inside the unit's sandbox, the sysusers entry creates the user,
and `cmake --install` lays the files out as documented."""

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

import deploy_common as dc

INSTALLED_DAEMON = "/usr/sbin/memoffloadd"


def _unit_copy(tmp_path: Path) -> Path:
    """The unit with ExecStart pointing at a binary that exists here:
    systemd-analyze verify rejects units whose ExecStart binary is missing."""
    binary = dc.daemon_binary(required=False) or Path(shutil.which("true"))
    text = dc.UNIT.read_text()
    assert f"ExecStart={INSTALLED_DAEMON} " in text
    copy = tmp_path / dc.UNIT.name
    copy.write_text(text.replace(f"ExecStart={INSTALLED_DAEMON} ", f"ExecStart={binary} "))
    return copy


def test_unit_has_the_required_settings():
    service = dc.unit_settings()["Service"]
    expected = {
        "Type": "notify", "NotifyAccess": "main", "RuntimeDirectory": "memoffload",
        "LimitMEMLOCK": "infinity", "AmbientCapabilities": "CAP_IPC_LOCK",
        "CapabilityBoundingSet": "CAP_IPC_LOCK", "User": "memoffload", "Group": "memoffload",
        "KillSignal": "SIGTERM", "ProtectSystem": "strict", "ProtectHome": "yes",
        "NoNewPrivileges": "yes", "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
        "SystemCallArchitectures": "native", "MemoryDenyWriteExecute": "yes",
    }
    for key, value in expected.items():
        assert service.get(key) == [value], f"{key}={service.get(key)}, want {value}"
    assert service["RuntimeDirectoryMode"][0] in ("0750", "0755")
    assert "/run/" + service["RuntimeDirectory"][0] == dc.default_runtime_dir()
    # GPU device nodes and the service user's shared memory must keep working.
    for key in ("PrivateDevices", "RemoveIPC", "PrivateUsers", "DevicePolicy"):
        assert key not in service, f"{key}= breaks GPU nodes or shared memory"
    assert dc.parse_duration_s(service["WatchdogSec"][0]) > 0
    (exec_start,) = service["ExecStart"]
    assert exec_start.split()[:3] == [INSTALLED_DAEMON, "--config",
                                      "/etc/memoffload/memoffloadd.toml"]
    assert "--runtime-dir=${RUNTIME_DIRECTORY}" in exec_start.split()
    assert service["ExecReload"] == ["/bin/kill -HUP $MAINPID"]


def test_stop_timeout_outlasts_the_drain_timeout():
    stop = dc.parse_duration_s(dc.unit_settings()["Service"]["TimeoutStopSec"][0])
    drains = [dc.parse_duration_s(dc.example_toml()["lifecycle"]["drain_timeout"])]
    if dc.default_drain_timeout_s() is not None:
        drains.append(dc.default_drain_timeout_s())
    assert stop >= max(drains) + 10


def test_systemd_analyze_verify(tmp_path):
    analyze = dc.require_tool("systemd-analyze")
    unit = _unit_copy(tmp_path)
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True)
    output = result.stdout + result.stderr
    # verify exits 0 on unknown keys and bad values but names the file.
    assert result.returncode == 0 and unit.name not in output, output


def test_exposure_score_not_above_recorded(tmp_path):
    analyze = dc.require_tool("systemd-analyze")
    unit = _unit_copy(tmp_path)
    result = subprocess.run([analyze, "security", "--offline=yes", str(unit)],
                            capture_output=True, text=True)
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", result.stdout)
    assert m, result.stdout + result.stderr
    score, recorded = float(m.group(1)), dc.recorded_exposure()
    assert score <= recorded, f"exposure rose to {score} (recorded {recorded} in docs/deploy.md)"


def test_sysusers_creates_the_service_user_and_group(tmp_path):
    sysusers = dc.require_tool("systemd-sysusers")
    (tmp_path / "etc").mkdir()
    result = subprocess.run([sysusers, f"--root={tmp_path}", str(dc.SYSUSERS)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    passwd = (tmp_path / "etc/passwd").read_text().splitlines()
    group = (tmp_path / "etc/group").read_text().splitlines()
    (user,) = [line.split(":") for line in passwd if line.startswith("memoffload:")]
    (grp,) = [line.split(":") for line in group if line.startswith("memoffload:")]
    assert user[3] == grp[2], "primary group of memoffload is not the memoffload group"
    assert int(user[2]) < 1000, "not a system uid"
    assert user[6].endswith("nologin")


def _expand_syscall_set(analyze: str, names: list[str]) -> set[str]:
    out: set[str] = set()
    pending = list(names)
    while pending:
        name = pending.pop()
        if not name.startswith("@"):
            out.add(name)
            continue
        listing = subprocess.run([analyze, "syscall-filter", name], capture_output=True,
                                 text=True, check=True).stdout
        for line in listing.splitlines()[1:]:
            item = line.strip()
            if item and not item.startswith("#"):
                pending.append(item)
    return out


def test_daemon_stays_inside_the_units_sandbox(tmp_path):
    """Runs the daemon under strace and checks that every syscall is allowed by
    SystemCallFilter=, every socket family by RestrictAddressFamilies=, and
    that no mapping is writable and executable (MemoryDenyWriteExecute=)."""
    binary = dc.daemon_binary()
    strace = dc.require_tool("strace")
    analyze = dc.require_tool("systemd-analyze")
    runtime = tmp_path / "rt"
    runtime.mkdir()
    trace = tmp_path / "trace"
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    port, health_port = ports
    proc = subprocess.Popen(
        [strace, "-f", "-qq", "-o", str(trace), str(binary), "--runtime-dir", str(runtime),
         "--arena-size", "64MiB", "--metrics-address", f"127.0.0.1:{port}",
         "--health-address", f"127.0.0.1:{health_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        broker, grpc = dc.socket_names()
        deadline = time.monotonic() + 60
        while not ((runtime / grpc).exists() and (runtime / broker).exists()):
            if proc.poll() is not None:
                pytest.fail(f"daemon exited under strace ({proc.returncode}): "
                            f"{proc.stderr.read()[-600:]}")
            assert time.monotonic() < deadline, "daemon did not start under strace"
            time.sleep(0.1)
        ctl = dc.bin_dir() / "memoffloadctl"
        if ctl.is_file():
            subprocess.run([str(ctl), "--runtime-dir", str(runtime), "status"],
                           capture_output=True, timeout=30)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
            c.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            c.recv(65536)
        # The health listener binds just after the sockets appear.
        while True:
            try:
                c = socket.create_connection(("127.0.0.1", health_port), timeout=5)
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline, "health port never accepted under strace"
                time.sleep(0.1)
        with c:
            c.sendall(b"GET /readyz HTTP/1.0\r\n\r\n")
            assert c.recv(65536).startswith(b"HTTP/1.1 200 OK")
        # Signal the daemon (the first pid in the trace), not strace: strace
        # would detach and leave the daemon running.
        daemon_pid = int(trace.read_text().split(None, 1)[0])
        os.kill(daemon_pid, signal.SIGTERM)
        assert proc.wait(60) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = trace.read_text()
    used = set(re.findall(r"^\d+\s+([a-z0-9_]+)\(", text, re.M))
    service = dc.unit_settings()["Service"]
    allowed = _expand_syscall_set(analyze, " ".join(service["SystemCallFilter"]).split())
    # execve of the binary itself happens before the filter is installed.
    assert not used - allowed - {"execve"}, f"outside SystemCallFilter: {used - allowed}"
    families = set(re.findall(r"socket\((AF_[A-Z0-9]+)", text))
    assert families <= set(service["RestrictAddressFamilies"][0].split()), families
    wx = [line for line in text.splitlines()
          if re.search(r"\bmmap\(.*PROT_WRITE\|PROT_EXEC|\bmmap\(.*PROT_EXEC\|PROT_WRITE", line)
          or re.search(r"\bmprotect\(.*PROT_EXEC", line)]
    assert not wx, wx[:5]


def _install_tree(tmp_path: Path, prefix: str, name: str, root: Path = dc.REPO) -> Path:
    """Configures a tiny project with stand-in memoffloadd/memoffloadctl
    targets that include `root`/cmake/install.cmake, installs it into a
    DESTDIR and returns the DESTDIR."""
    cmake = dc.require_tool("cmake")
    src = tmp_path / f"{name}-src"
    src.mkdir()
    (src / "main.c").write_text("int main(void) { return 0; }\n")
    (src / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.22)\n"
        "project(memoffload VERSION 0.0.0 LANGUAGES C)\n"
        "add_executable(memoffloadd main.c)\n"
        "add_executable(memoffloadctl main.c)\n"
        f'include("{root}/cmake/install.cmake")\n')
    build = tmp_path / f"{name}-build"
    dest = tmp_path / f"{name}-dest"
    for command in ([cmake, "-S", str(src), "-B", str(build), f"-DCMAKE_INSTALL_PREFIX={prefix}"],
                    [cmake, "--build", str(build)]):
        result = subprocess.run(command, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr
    install(build, dest)
    return dest


def install(build: Path, dest: Path) -> None:
    env = dict(os.environ, DESTDIR=str(dest))
    result = subprocess.run([shutil.which("cmake"), "--install", str(build)],
                            capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stdout + result.stderr


def test_install_rules_lay_out_files_for_prefix_usr(tmp_path):
    dest = _install_tree(tmp_path, "/usr", "usr")
    for path in ("usr/sbin/memoffloadd", "usr/bin/memoffloadctl",
                 "usr/lib/systemd/system/memoffloadd.service",
                 "usr/lib/sysusers.d/memoffload.conf",
                 "etc/memoffload/memoffloadd.toml",
                 "usr/share/doc/memoffload/examples/memoffloadd.toml",
                 "usr/share/doc/memoffload/deploy.md",
                 "usr/share/doc/memoffload/running.md",
                 "usr/share/memoffload/grafana"):
        assert (dest / path).exists(), path
    # With prefix /usr the installed unit is the reviewed file, byte for byte.
    assert (dest / "usr/lib/systemd/system/memoffloadd.service").read_text() == \
        dc.UNIT.read_text()
    grafana = sorted(p.relative_to(dc.REPO / "grafana").as_posix()
                     for p in (dc.REPO / "grafana").rglob("*") if p.is_file())
    installed = sorted(p.relative_to(dest / "usr/share/memoffload/grafana").as_posix()
                       for p in (dest / "usr/share/memoffload/grafana").rglob("*")
                       if p.is_file())
    assert installed == grafana


def test_install_keeps_an_existing_config(tmp_path):
    dest = _install_tree(tmp_path, "/usr", "keep")
    config = dest / "etc/memoffload/memoffloadd.toml"
    config.write_text("# operator's settings\n")
    install(tmp_path / "keep-build", dest)
    assert config.read_text() == "# operator's settings\n"


def test_editing_the_unit_reconfigures_before_the_next_install(tmp_path):
    """install.cmake reads the unit at configure time; an edited unit must not
    leave the stale copy in the build tree (CMAKE_CONFIGURE_DEPENDS)."""
    root = tmp_path / "root"
    for part in ("cmake", "deploy/systemd", "grafana"):
        shutil.copytree(dc.REPO / part, root / part)
    (root / "docs").mkdir()
    for doc in ("deploy.md", "running.md"):
        shutil.copy(dc.REPO / "docs" / doc, root / "docs" / doc)
    dest = _install_tree(tmp_path, "/usr", "edit", root)
    unit = root / "deploy/systemd/memoffloadd.service"
    unit.write_text(unit.read_text() + "# edited after configure\n")
    # An edit within the configure's second would look as old as its outputs.
    later = time.time() + 5
    os.utime(unit, (later, later))
    build = tmp_path / "edit-build"
    result = subprocess.run([shutil.which("cmake"), "--build", str(build)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    # The regenerated unit is in the build tree now; cmake --install compares
    # whole seconds, so age the installed copy to make it install again.
    installed_unit = dest / "usr/lib/systemd/system/memoffloadd.service"
    os.utime(installed_unit, (time.time() - 60, time.time() - 60))
    install(build, dest)
    installed = installed_unit.read_text()
    assert installed.endswith("# edited after configure\n"), installed[-200:]


def test_install_rewrites_unit_paths_for_another_prefix(tmp_path):
    dest = _install_tree(tmp_path, "/opt/mo", "opt")
    unit = dest / "opt/mo/lib/systemd/system/memoffloadd.service"
    (exec_start,) = dc.unit_settings(unit)["Service"]["ExecStart"]
    binary, flag, config = exec_start.split()[:3]
    # GNUInstallDirs puts the config dir of prefix /opt/mo under /etc/opt/mo.
    assert (binary, flag, config) == ("/opt/mo/sbin/memoffloadd", "--config",
                                      "/etc/opt/mo/memoffload/memoffloadd.toml")
    assert (dest / binary.lstrip("/")).is_file()
    assert (dest / config.lstrip("/")).is_file()
