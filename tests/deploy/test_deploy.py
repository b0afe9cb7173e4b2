"""Static checks of deploy/: Kubernetes manifests, Dockerfile, Prometheus
config and example configs agree with each other and with the daemon's
defaults (read from its sources), and the image's packages match
scripts/setup-deps.sh."""

import re
import tomllib
import subprocess
from pathlib import Path

import pytest
import yaml

import deploy_common as dc

MIB = 1024 * 1024


# ---------------------------------------------------------------- Kubernetes


def test_yamllint_passes_on_k8s_prometheus_and_grafana_provisioning_yaml():
    yamllint = dc.require_tool("yamllint")
    provisioning = sorted((dc.REPO / "grafana" / "provisioning").rglob("*.yaml"))
    assert len(provisioning) >= 2, provisioning
    result = subprocess.run(
        [yamllint, "--strict", "--format", "parsable", str(dc.K8S), str(dc.PROMETHEUS),
         str(dc.DEPLOY / "node"), *map(str, provisioning)],
        capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_node_s_huge_page_setting_is_advise_for_the_daemonset_s_namesake():
    """deploy/node (docs/deploy.md, 'Huge pages'): the tmpfiles line and the
    init container both set shared-memory THP to 'advise' (never 'always'
    or 'within_size'), on the DaemonSet the base deploys."""
    knob = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
    lines = [x.split() for x in (dc.DEPLOY / "node" / "memoffload-thp.tmpfiles.conf").read_text()
             .splitlines() if x.strip() and not x.startswith("#")]
    assert lines == [["w", knob, "-", "-", "-", "-", "advise"]], lines
    patch = yaml.safe_load((dc.DEPLOY / "node" / "shmem-thp-patch.yaml").read_text())
    (base,) = [d for d in yaml.safe_load_all((dc.K8S / "daemonset.yaml").read_text())
               if d and d.get("kind") == "DaemonSet"]
    assert patch["kind"] == "DaemonSet"
    assert patch["metadata"]["name"] == base["metadata"]["name"]
    (init,) = patch["spec"]["template"]["spec"]["initContainers"]
    script = init["command"][-1]
    assert "cd /host-sys/kernel/mm/transparent_hugepage &&" in script, script
    assert "echo advise > shmem_enabled" in script, script
    (volume,) = patch["spec"]["template"]["spec"]["volumes"]
    assert volume["hostPath"]["path"] == "/sys"
    # The daemon's own container is not touched (it stays unprivileged).
    assert "containers" not in patch["spec"]["template"]["spec"]


def test_kustomization_lists_every_manifest_and_only_those():
    kustomization = yaml.safe_load((dc.K8S / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    present = {p.name for p in dc.K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present, f"listed {sorted(listed)}, present {sorted(present)}"
    assert kustomization["namespace"] == "memoffload-system"
    # The sample trainer pod must not be deployed by the base.
    assert not any(r.startswith("examples") for r in listed)


def _daemonset_parts():
    docs = dc.k8s_documents()
    ds = dc.one(docs, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return docs, ds, pod, container


def test_daemonset_runs_on_every_node_as_critical_with_minimal_capabilities():
    _, ds, pod, c = _daemonset_parts()
    assert ds["apiVersion"] == "apps/v1"
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pod["priorityClassName"] == "system-node-critical"
    sc = c["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["privileged"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert not pod.get("hostIPC") and not pod.get("hostNetwork") and not pod.get("hostPID")


def test_daemonset_socket_dir_is_the_daemon_default_on_the_host():
    _, _, pod, c = _daemonset_parts()
    run_dir = dc.default_runtime_dir()
    volume = next(v for v in pod["volumes"] if "hostPath" in v)
    assert volume["hostPath"] == {"path": run_dir, "type": "DirectoryOrCreate"}
    mount = next(m for m in c["volumeMounts"] if m["name"] == volume["name"])
    assert mount["mountPath"] == run_dir
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env[dc.runtime_dir_env()] == run_dir


def test_a_rolling_update_is_a_take_over_between_the_pods():
    """maxSurge with the ConfigMap's take_over = auto and after_handover =
    wait, and each pod's keeper on a socket of its own in the shared runtime
    dir, the same path in both of the pod's containers (docs/restarts.md,
    "Take-over across pods")."""
    docs, ds, pod, c = _daemonset_parts()
    assert ds["spec"]["updateStrategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    lifecycle = dc.configmap_toml(docs)["lifecycle"]
    assert lifecycle["take_over"] == "auto" and lifecycle["after_handover"] == "wait"
    assert lifecycle["state_store"] == "keeper"
    (keeper,) = pod["initContainers"]
    assert keeper["restartPolicy"] == "Always" and keeper["args"][0] == "keeper"
    run_dir = dc.default_runtime_dir()
    for container in (keeper, c):
        env = container["env"]
        names = [e["name"] for e in env]
        pod_name = next(e for e in env if e["name"] == "POD_NAME")
        assert pod_name["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        sock = next(e for e in env if e["name"] == "MEMOFFLOAD_KEEPER_SOCKET")
        # $(POD_NAME) expands only when defined earlier in the list.
        assert names.index("POD_NAME") < names.index("MEMOFFLOAD_KEEPER_SOCKET")
        assert sock["value"] == f"{run_dir}/keeper-$(POD_NAME).sock", sock
        mount = next(m for m in container["volumeMounts"] if m["mountPath"] == run_dir)
        assert mount["name"] == "runtime-dir"


def test_daemonset_probes_use_the_health_port_of_the_configmap():
    docs, _, _, c = _daemonset_parts()
    health = dc.configmap_toml(docs)["server"].get("health_address", "none")
    assert health != "none", "the ConfigMap must enable server.health_address for the probes"
    host, _, port = health.rpartition(":")
    # kubelet probes the pod IP: loopback would never answer.
    assert host in ("0.0.0.0", "[::]"), health
    ports = {p["name"]: p for p in c["ports"]}
    assert ports["health"] == {"name": "health", "containerPort": int(port), "protocol": "TCP"}
    paths = {"startupProbe": "/livez", "readinessProbe": "/readyz", "livenessProbe": "/livez"}
    for probe, path in paths.items():
        assert c[probe]["httpGet"]["port"] in ("health", int(port)), probe
        assert c[probe]["httpGet"]["path"] == path, probe
        assert "exec" not in c[probe] and "tcpSocket" not in c[probe], probe
    # The paths are the daemon's (daemon/observe/health.cc).
    source = (dc.REPO / "daemon" / "observe" / "health.cc").read_text()
    for path in set(paths.values()):
        assert f'"{path}"' in source, path
    # A pre-fault of a large arena must fit in the startup budget (15 min).
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 900
    # Liveness restarts drop every session: at least two minutes of failures.
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= 120


def test_daemonset_config_metrics_port_and_memory_agree_with_configmap():
    docs, _, pod, c = _daemonset_parts()
    config = dc.configmap_toml(docs)
    cm_name = dc.one(docs, "ConfigMap")["metadata"]["name"]
    volume = next(v for v in pod["volumes"] if "configMap" in v)
    assert volume["configMap"]["name"] == cm_name
    mount = next(m for m in c["volumeMounts"] if m["name"] == volume["name"])
    assert c["args"] == ["--config", f"{mount['mountPath']}/memoffloadd.toml"]
    port = dc.default_metrics_port()
    ports = {p["name"]: p for p in c["ports"]}
    assert set(ports) == {"metrics", "health"}, ports
    assert ports["metrics"] == {"name": "metrics", "containerPort": port, "protocol": "TCP"}
    # The memfd pages of the arena are charged to the daemon's container.
    arena = dc.parse_size_bytes(config["arena"]["size"])
    limit = dc.parse_size_bytes(c["resources"]["limits"]["memory"])
    assert limit >= arena + 256 * MIB
    assert c["resources"]["requests"]["memory"] == c["resources"]["limits"]["memory"]
    # SIGTERM drains: the grace period must outlast the drain timeout.
    drain = dc.parse_duration_s(config["lifecycle"]["drain_timeout"])
    assert pod["terminationGracePeriodSeconds"] >= drain + 10


def test_configmap_serves_metrics_on_all_pod_interfaces_and_default_dirs():
    docs = dc.k8s_documents()
    config = dc.configmap_toml(docs)
    assert config["server"]["metrics_address"] == f"0.0.0.0:{dc.default_metrics_port()}"
    assert config["server"]["runtime_dir"] == dc.default_runtime_dir()
    ds = dc.one(docs, "DaemonSet")
    gid = ds["spec"]["template"]["spec"]["securityContext"]["runAsGroup"]
    assert config["access"]["allowed_gids"] == [gid]


def test_pod_user_and_group_ids_match_the_dockerfile_user():
    """The image's user is 10001:10001 (USER, useradd/groupadd); the DaemonSet
    keeps that group (socket ownership) and runs as that user or, for
    CAP_IPC_LOCK (see the comment in daemonset.yaml), as uid 0 with only
    IPC_LOCK added."""
    runtime = dc.dockerfile_stages()["runtime"]
    (user,) = [rest for word, rest in runtime if word == "USER"]
    uid, gid = (int(x) for x in user.split(":"))
    commands = " ".join(rest for word, rest in runtime if word == "RUN")
    assert f"--uid {uid}" in commands and f"--gid {gid}" in commands, commands
    docs, _, pod, c = _daemonset_parts()
    security = pod["securityContext"]
    assert security["runAsGroup"] == gid
    assert security["runAsUser"] in (uid, 0)
    if security["runAsUser"] == 0:
        assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        assert c["securityContext"]["runAsNonRoot"] is False
    else:
        assert c["securityContext"].get("runAsNonRoot", True) is True
    trainers = [p for p in docs["Pod"] if p["__file__"].startswith("examples/")]
    assert trainers
    for trainer in trainers:
        assert trainer["spec"]["securityContext"]["runAsGroup"] == gid, trainer["__file__"]


def test_service_and_servicemonitor_select_the_daemon_pods():
    docs, ds, _, _ = _daemonset_parts()
    svc = dc.one(docs, "Service")
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert svc["spec"]["clusterIP"] == "None"
    (svc_port,) = svc["spec"]["ports"]
    assert svc_port["port"] == dc.default_metrics_port()
    assert svc_port["targetPort"] == "metrics"
    sm = dc.one(docs, "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] == svc_port["name"]
    assert endpoint["path"] == "/metrics"
    # Same job label as the static Prometheus config and the dashboards.
    assert svc["metadata"]["labels"][sm["spec"]["jobLabel"]] == "memoffload"


def test_sample_trainer_pod_mounts_the_socket_dir_and_can_attach():
    docs = dc.k8s_documents()
    (pod,) = [p for p in docs["Pod"] if p["__file__"] == "examples/trainer-pod.yaml"]
    run_dir = dc.default_runtime_dir()
    volume = next(v for v in pod["spec"]["volumes"] if "hostPath" in v)
    assert volume["hostPath"]["path"] == run_dir
    (c,) = pod["spec"]["containers"]
    mount = next(m for m in c["volumeMounts"] if m["name"] == volume["name"])
    assert mount["mountPath"] == run_dir
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env[dc.runtime_dir_env()] == run_dir
    config = dc.configmap_toml(docs)
    assert pod["spec"]["securityContext"]["runAsGroup"] in config["access"]["allowed_gids"]


# ---------------------------------------------------------------- Dockerfile


def test_dockerfile_is_multistage_debian_bookworm():
    instructions = dc.dockerfile_instructions()
    args = dict(rest.split("=", 1) for word, rest in instructions if word == "ARG")
    assert args["DEBIAN_IMAGE"].startswith("debian:bookworm")
    froms = [rest for word, rest in instructions if word == "FROM"]
    assert froms == ["${DEBIAN_IMAGE} AS build", "${DEBIAN_IMAGE} AS runtime"]


def test_dockerfile_build_packages_equal_setup_deps_build_array():
    packages = dc.apt_packages(dc.dockerfile_stages()["build"])
    deps = dc.deps_array("DEPS_BUILD")
    assert sorted(packages) == sorted(deps), (
        f"only in Dockerfile: {sorted(set(packages) - set(deps))}, "
        f"only in setup-deps.sh: {sorted(set(deps) - set(packages))}")


def test_dockerfile_runtime_stage_has_no_build_packages_and_a_non_root_user():
    runtime = dc.dockerfile_stages()["runtime"]
    packages = dc.apt_packages(runtime)
    assert packages and not [p for p in packages if p.endswith("-dev")]
    assert not set(packages) & set(dc.deps_array("DEPS_BUILD"))
    user = [rest for word, rest in runtime if word == "USER"]
    assert user == ["10001:10001"]
    useradd = " ".join(rest for word, rest in runtime if word == "RUN")
    assert "--uid 10001" in useradd and "--gid 10001" in useradd


def test_dockerfile_runtime_packages_cover_the_built_binaries_libraries():
    binaries = [dc.bin_dir() / b for b in ("memoffloadd", "memoffloadctl")]
    missing = [str(b) for b in binaries if not b.is_file()]
    assert not missing, f"not built: {missing} (set MEMOFFLOAD_BIN_DIR)"
    # Direct dependencies (DT_NEEDED) only: apt pulls in what those need.
    libraries = set()
    for binary in binaries:
        ldd = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=True)
        paths = dict(re.findall(r"^\s*(\S+)\s+=>\s+(/\S+)", ldd.stdout, re.M))
        dynamic = subprocess.run(["readelf", "-d", str(binary)], capture_output=True, text=True,
                                 check=True)
        for soname in re.findall(r"\(NEEDED\).*\[(.+)\]", dynamic.stdout):
            if soname.startswith("ld-linux"):
                continue  # the dynamic loader, part of libc6
            libraries.add(paths[soname])
    needed = set()
    for lib in sorted(libraries):
        real = Path(lib).resolve()
        for candidate in (lib, str(real), str(real).removeprefix("/usr"), "/usr" + str(real)):
            found = subprocess.run(["dpkg", "-S", candidate], capture_output=True, text=True)
            if found.returncode == 0:
                needed.add(found.stdout.split(":")[0])
                break
        else:
            pytest.fail(f"no Debian package owns {lib}")
    packages = set(dc.apt_packages(dc.dockerfile_stages()["runtime"]))
    assert needed <= packages, f"runtime stage lacks {sorted(needed - packages)}"


def test_dockerfile_paths_ports_and_run_line_match_the_daemon():
    runtime = dc.dockerfile_stages()["runtime"]
    run_dir = dc.default_runtime_dir()
    port = dc.default_metrics_port()
    env = [rest for word, rest in runtime if word == "ENV"]
    assert f"{dc.runtime_dir_env()}={run_dir}" in env
    assert [rest for word, rest in runtime if word == "EXPOSE"] == [str(port)]
    cmd = [rest for word, rest in runtime if word == "CMD"]
    assert cmd == [f'["--runtime-dir={run_dir}", "--metrics-address=0.0.0.0:{port}"]']
    assert [rest for word, rest in runtime if word == "ENTRYPOINT"] == ['["/usr/sbin/memoffloadd"]']
    text = dc.DOCKERFILE.read_text()
    run_line = text[text.index("#   docker run"):text.index("\n#\n", text.index("#   docker run"))]
    for option in ("--ulimit memlock=-1:-1", f"-v {run_dir}:{run_dir}",
                   f"-p 127.0.0.1:{port}:{port}", f"--runtime-dir={run_dir}",
                   f"--metrics-address=0.0.0.0:{port}"):
        assert option in run_line, option
    assert "--ipc" in text and "/dev/shm" in text


# ---------------------------------------------------------------- Prometheus


def test_prometheus_config_is_valid_and_scrapes_the_metrics_port():
    promtool = dc.require_tool("promtool")
    result = subprocess.run([promtool, "check", "config", str(dc.PROMETHEUS)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    config = yaml.safe_load(dc.PROMETHEUS.read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "memoffload"]
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    assert targets and all(t.endswith(f":{dc.default_metrics_port()}") for t in targets)
    assert job["metrics_path"] == "/metrics"


def test_readme_prometheus_config_is_valid_and_scrapes_the_default_address(tmp_path):
    promtool = dc.require_tool("promtool")
    readme = (dc.REPO / "README.md").read_text()
    section = readme[readme.index("## Metrics"):]
    section = section[:section.index("\n## ", 1)]
    m = re.search(r"cat > (\S+) <<'EOF'\n(.*?)\nEOF\n", section, re.S)
    assert m, "README's Metrics section has no Prometheus config here-document"
    config = tmp_path / "prometheus.yml"
    config.write_text(m.group(2) + "\n")
    result = subprocess.run([promtool, "check", "config", str(config)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    (job,) = yaml.safe_load(config.read_text())["scrape_configs"]
    assert job["job_name"] == "memoffload"
    assert job["static_configs"][0]["targets"] == [dc.default_metrics_address()]
    assert f"--config.file={m.group(1)}" in section


# ---------------------------------------------------------------- configs


def test_example_config_matches_daemon_defaults_and_unit():
    config = dc.example_toml()
    assert config["server"]["runtime_dir"] == dc.default_runtime_dir()
    assert config["server"]["metrics_address"] == dc.default_metrics_address()
    default_drain = dc.default_drain_timeout_s()
    if default_drain is not None:
        assert dc.parse_duration_s(config["lifecycle"]["drain_timeout"]) == default_drain


@pytest.mark.parametrize("source", ["systemd example", "k8s configmap"])
def test_config_files_are_accepted_by_the_daemon(source, tmp_path):
    binary = dc.daemon_binary()
    if source == "systemd example":
        path = dc.EXAMPLE_CONFIG
    else:
        path = tmp_path / "memoffloadd.toml"
        path.write_text(dc.one(dc.k8s_documents(), "ConfigMap")["data"]["memoffloadd.toml"])
    env = {"PATH": "/usr/bin:/bin"}
    result = subprocess.run([str(binary), "--config", str(path), "--print-config"],
                            capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    # Every key of the file is in effect, not ignored.
    effective = tomllib.loads(result.stdout)
    for section, values in tomllib.loads(path.read_text()).items():
        for key, value in values.items():
            assert key in effective[section], f"[{section}] {key}"
            if isinstance(value, str) and section == "server":
                assert effective[section][key] == value, f"[{section}] {key}"


def _setting_keys(toml_text: str, commented: bool) -> set[str]:
    """section.key of every setting line; with commented, '# key = ...' too."""
    keys, section = set(), None
    pattern = re.compile(r"^(?:#\s*)?([a-z_]+)\s*=" if commented else r"^([a-z_]+)\s*=")
    for line in toml_text.splitlines():
        header = re.match(r"^(?:#\s*)?\[([a-z_]+)\]\s*$", line.strip())
        if header:
            section = header.group(1)
            continue
        m = pattern.match(line.strip())
        if m and section:
            keys.add(f"{section}.{m.group(1)}")
    return keys


def test_example_config_documents_every_setting():
    """Every setting --print-config knows appears in the example, in its section."""
    binary = dc.daemon_binary()
    env = {"PATH": "/usr/bin:/bin"}
    printed = subprocess.run([str(binary), "--print-config"], capture_output=True, text=True,
                             env=env)
    assert printed.returncode == 0, printed.stderr
    known = _setting_keys(printed.stdout, commented=False)
    assert len(known) > 10, printed.stdout
    example = _setting_keys(dc.EXAMPLE_CONFIG.read_text(), commented=True)
    assert sorted(known - example) == [], f"settings missing from {dc.EXAMPLE_CONFIG}"
    assert sorted(example - known) == [], f"unknown settings in {dc.EXAMPLE_CONFIG}"
