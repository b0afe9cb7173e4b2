#!/usr/bin/python3
"""Metrics and dashboard tests against the real memoffloadd.

  metrics_test.py --bin-dir DIR PromtoolTest     promtool check metrics on /metrics
  metrics_test.py --bin-dir DIR DriftTest        dashboard <-> exported metrics
  metrics_test.py --bin-dir DIR DashboardE2ETest every panel query through a real
                                                 Prometheus scraping the daemon

Every test starts its own daemon (loopback metrics, temporary runtime dir) and
drives it with `memoffload-bench load`; servers are always stopped. Uses only
the standard library and python3-yaml (Debian's /usr/bin/python3).
"""

import argparse
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "grafana" / "dashboards" / "memoffload.json"
PROVISIONING = REPO / "grafana" / "provisioning"
DOC = REPO / "docs" / "observability.md"
METRICS_SOURCE = REPO / "daemon" / "observe" / "metrics.cc"
BIN_DIR = Path(os.environ.get("MEMOFFLOAD_BIN_DIR", REPO / "build" / "bin"))

# Exported families no panel has to show, and why.
UNUSED_ALLOWED = {
    "exposer_transferred_bytes_total": "prometheus-cpp's own HTTP exposer statistics",
    "exposer_scrapes_total": "prometheus-cpp's own HTTP exposer statistics",
    "exposer_request_latencies": "prometheus-cpp's own HTTP exposer statistics",
}
# Series Prometheus itself attaches to every target; panels may use them.
PROMETHEUS_SERIES = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
# PromQL words that look like identifiers but are not metric names.
PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
    "unless", "offset", "sum", "avg", "min", "max", "count", "rate", "irate", "increase",
    "histogram_quantile", "topk", "bottomk", "quantile", "stddev", "stdvar", "abs", "clamp_min",
    "clamp_max", "delta", "deriv", "time", "timestamp", "label_replace", "vector", "scalar",
    "absent", "changes", "resets", "sort", "sort_desc", "count_values", "group", "last_over_time",
    "max_over_time", "min_over_time", "avg_over_time", "sum_over_time", "inf", "nan",
}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
RATE_INTERVAL = "15s"


# ---- processes --------------------------------------------------------------

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen, timeout: float = 10) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_until(predicate, timeout: float, what: str, interval: float = 0.1):
    """Polls predicate until it returns a true value; fails naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def http_get(url: str, timeout: float = 5) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode("utf-8")


class Daemon:
    """The real memoffloadd in a temporary runtime dir, metrics on 127.0.0.1:0."""

    def __init__(self, scratch: Path, extra_args=()):
        self.runtime_dir = scratch / "rt"
        self.log_path = scratch / "memoffloadd.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [str(BIN_DIR / "memoffloadd"), "--runtime-dir", str(self.runtime_dir),
             "--arena-size", "128MiB", "--chunk-size", "32MiB",
             "--metrics-address", "127.0.0.1:0", "--drain-timeout", "2s", *extra_args],
            stdout=self._log, stderr=subprocess.STDOUT)
        try:
            status = wait_until(self._status, 20, "memoffloadd to answer GetStatus")
        except AssertionError:
            self.close()
            raise AssertionError("memoffloadd did not come up:\n" + self.log())
        self.metrics_address = status.get("metricsAddress") or status.get("metrics_address")
        if not self.metrics_address:
            self.close()
            raise AssertionError(f"GetStatus has no metrics address: {status}")

    def _status(self):
        if self.proc.poll() is not None:
            raise AssertionError(f"memoffloadd exited with {self.proc.returncode}:\n" + self.log())
        r = subprocess.run(
            [str(BIN_DIR / "memoffloadctl"), "--runtime-dir", str(self.runtime_dir), "--json",
             "status"], capture_output=True, text=True, timeout=10)
        return json.loads(r.stdout) if r.returncode == 0 else None

    def metrics(self) -> str:
        return http_get(f"http://{self.metrics_address}/metrics")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def close(self):
        stop(self.proc)
        self._log.close()


def run_load(daemon: Daemon, clients: int, seconds: float, max_bytes: str | None = None) -> dict:
    """Runs memoffload-bench load; returns its JSON summary line."""
    argv = [str(BIN_DIR / "memoffload-bench"), "load", "--runtime-dir", str(daemon.runtime_dir),
            "--clients", str(clients), "--seconds", str(seconds), "--json",
            "--max-group", "2MiB"]
    if max_bytes:
        argv += ["--max-bytes", max_bytes]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60)
    lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    summary = [line for line in lines if line.get("summary")]
    if r.returncode != 0 or not summary:
        raise AssertionError(f"memoffload-bench load failed ({r.returncode}):\n{r.stdout}\n"
                             f"{r.stderr}")
    return summary[0]


def reclaim_one_session(daemon: Daemon) -> None:
    """A client that holds committed groups is SIGKILLed: its session is reclaimed."""
    worker = subprocess.Popen(
        [str(BIN_DIR / "offload_worker"), "hold", str(daemon.runtime_dir), "2", "1048576"],
        stdout=subprocess.PIPE, text=True)
    try:
        line = worker.stdout.readline()
        if not line.startswith("HELD"):
            raise AssertionError(f"offload_worker hold said {line!r}")
    finally:
        worker.kill()
        worker.wait()
        worker.stdout.close()

    def reclaimed():
        m = re.search(r'^memoffload_sessions_reclaimed_total\{reason="lifeline_closed"\} (\S+)$',
                      daemon.metrics(), re.M)
        return m and float(m.group(1)) >= 1
    wait_until(reclaimed, 10, "the killed session to be reclaimed")


def save_one_region(daemon: Daemon) -> None:
    """A process writes and commits a checkpoint region (the regions row's data)."""
    r = subprocess.run([str(BIN_DIR / "region_worker"), "write", str(daemon.runtime_dir),
                        "metrics-test", f"ckpt-{time.monotonic_ns()}", "65536", "commit"],
                       capture_output=True, text=True, timeout=30)
    if r.returncode != 0 or r.stdout != "OK\n":
        raise AssertionError(f"region_worker said {r.stdout!r} {r.stderr!r}")


# ---- exposition and dashboard parsing ----------------------------------------

def exported_families(text: str) -> dict:
    """{family name: type} from the # TYPE lines of an exposition."""
    families = {}
    for line in text.splitlines():
        m = re.match(r"# TYPE (\S+) (\S+)", line)
        if m:
            families[m.group(1)] = m.group(2)
    return families


def declared_families() -> dict:
    """{family name: type} of every family daemon/observe/metrics.cc defines, with or
    without series: prometheus-cpp prints no # TYPE line for a family that has
    no series yet (tests/daemon/observe/metrics_test.cc checks that), so a scrape alone
    misses e.g. the per-rank families on an idle daemon."""
    text = METRICS_SOURCE.read_text()
    families = {}
    for kind, name in re.findall(r'Build(Counter|Gauge|Histogram|Summary)\(\)\s*'
                                 r'\.Name\(\s*"([^"]+)"', text):
        families[name] = kind.lower()
    for name in re.findall(r'GaugeFamily\(\s*"([^"]+)"', text):
        families[name] = "gauge"
    for name in re.findall(r'CounterOf\(\s*"([^"]+)"', text):
        families[name] = "counter"
    return families


def documented_families() -> dict:
    """{family name: type} of the metric table in docs/observability.md."""
    families = {}
    for m in re.finditer(r"^\|\s*`([a-z_:][a-z0-9_:]*)`\s*\|\s*(\w+)\s*\|", DOC.read_text(),
                         re.M):
        families[m.group(1)] = m.group(2)
    return families


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def data_panels(dashboard: dict):
    """Every panel that shows data (rows excluded), including those in collapsed rows."""
    for p in dashboard["panels"]:
        if p.get("type") == "row":
            yield from p.get("panels", [])
        else:
            yield p


def metric_names(expr: str) -> set:
    """Metric names used by a PromQL expression."""
    no_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    no_groupings = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)",
                          r"\1", no_strings)
    no_matchers = re.sub(r"\{[^}]*\}", "{}", no_groupings)
    no_ranges = re.sub(r"\[[^\]]*\]", "[]", no_matchers)
    names = set()
    for m in re.finditer(r"(?<![\w$.])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\()?", no_ranges):
        word, call = m.group(1), m.group(2)
        if call or word in PROMQL_WORDS:
            continue
        names.add(word)
    return names


def family_of(series: str, families: dict) -> str | None:
    if series in families:
        return series
    for suffix in HISTOGRAM_SUFFIXES:
        base = series[: -len(suffix)] if series.endswith(suffix) else None
        if base and families.get(base) in ("histogram", "summary"):
            return base
    return None


def substitute(expr: str, job: str, instance: str) -> str:
    for var, value in (("job", job), ("instance", instance), ("__rate_interval", RATE_INTERVAL)):
        expr = expr.replace("${" + var + "}", value).replace("$" + var, value)
    return expr


# ---- tests -------------------------------------------------------------------

class DaemonTestCase(unittest.TestCase):
    def setUp(self):
        for tool in ("memoffloadd", "memoffloadctl", "memoffload-bench", "offload_worker"):
            self.assertTrue((BIN_DIR / tool).is_file(), f"{BIN_DIR / tool} is not built")
        self.scratch = Path(tempfile.mkdtemp(prefix="memoffload-metrics-"))
        self.addCleanup(shutil.rmtree, self.scratch, ignore_errors=True)
        self.daemon = Daemon(self.scratch)
        self.addCleanup(self.daemon.close)

    def drive_traffic(self, seconds: float = 2) -> dict:
        """Load with a session limit (so some Reserves are refused), one reclaim
        and one checkpoint region written and committed."""
        reclaim_one_session(self.daemon)
        save_one_region(self.daemon)
        summary = run_load(self.daemon, clients=2, seconds=seconds, max_bytes="3MiB")
        self.assertGreater(summary["cycles"], 0, summary)
        self.assertGreater(summary["rejected"], 0, f"no Reserve hit the session limit: {summary}")
        self.assertEqual(summary["verify_failures"], 0, summary)
        return summary


class PromtoolTest(DaemonTestCase):
    def test_promtool_accepts_metrics_before_and_after_traffic(self):
        promtool = shutil.which("promtool")
        self.assertIsNotNone(promtool, "promtool not found (Debian package prometheus)")
        for phase in ("idle", "after traffic"):
            if phase == "after traffic":
                self.drive_traffic()
            text = self.daemon.metrics()
            r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                               text=True, timeout=30)
            self.assertEqual(r.returncode, 0,
                             f"promtool check metrics ({phase}):\n{r.stdout}{r.stderr}")
            # promtool reports lint problems on stdout/stderr even with exit 0 in some
            # versions; any complaint is a failure.
            self.assertEqual((r.stdout + r.stderr).strip(), "", f"promtool ({phase}) complained")


class DriftTest(DaemonTestCase):
    def test_panels_are_complete_and_use_exported_metrics_only(self):
        self.drive_traffic()
        # What the daemon can export: every family metrics.cc defines (some
        # have no series yet), and whatever this scrape shows.
        families = {**declared_families(), **exported_families(self.daemon.metrics())}
        dashboard = load_dashboard()
        problems, used = [], set()
        variables = {v["name"] for v in dashboard["templating"]["list"]}
        for name in ("datasource", "job", "instance"):
            if name not in variables:
                problems.append(f"dashboard lacks the ${name} variable")
        panels = list(data_panels(dashboard))
        self.assertGreater(len(panels), 0)
        for p in panels:
            where = f"panel {p.get('title')!r}"
            if not p.get("fieldConfig", {}).get("defaults", {}).get("unit"):
                problems.append(f"{where} has no unit")
            if not p.get("description", "").strip():
                problems.append(f"{where} has no description")
            if p.get("datasource", {}).get("uid") != "${datasource}":
                problems.append(f"{where} does not use the $datasource variable")
            if not p.get("targets"):
                problems.append(f"{where} has no query")
            for t in p.get("targets", []):
                expr = t.get("expr", "")
                for rng in re.findall(r"\[([^\]]*)\]", expr):
                    if rng != "$__rate_interval":
                        problems.append(f"{where}: range [{rng}] is not [$__rate_interval]")
                for selector in re.findall(r"[a-zA-Z_:][\w:]*\{[^}]*\}", expr):
                    if 'job="$job"' not in selector or 'instance="$instance"' not in selector:
                        problems.append(f"{where}: {selector} is not scoped to $job/$instance")
                for name in metric_names(expr):
                    if name in PROMETHEUS_SERIES:
                        continue
                    family = family_of(name, families)
                    if family is None:
                        problems.append(f"{where} uses {name}, which the daemon does not export")
                    else:
                        used.add(family)
        for family in sorted(families):
            if family not in used and family not in UNUSED_ALLOWED:
                problems.append(f"exported metric {family} is shown by no panel "
                                "(add a panel or list it in UNUSED_ALLOWED with a reason)")
        for family in sorted(UNUSED_ALLOWED):
            if family not in families:
                problems.append(f"UNUSED_ALLOWED lists {family}, which is no longer exported")
        self.assertEqual(problems, [], "\n".join(problems))

    def test_metric_names_parser(self):
        self.assertEqual(
            metric_names('histogram_quantile(0.5, sum by (method, le) '
                         '(rate(a_bucket{job="$job",x="up"}[$__rate_interval]))) / b'),
            {"a_bucket", "b"})
        self.assertEqual(metric_names("up{job=\"x\"} == 1 and on (instance) c_total"),
                         {"up", "c_total"})

    def test_declared_families_are_what_the_daemon_exports(self):
        """The source parse finds every family a scrape after traffic shows
        (so it cannot go blind), with the same type."""
        self.drive_traffic()
        scraped = exported_families(self.daemon.metrics())
        declared = declared_families()
        ours = {f: t for f, t in scraped.items() if f not in UNUSED_ALLOWED}
        unknown = sorted(set(ours) - set(declared))
        self.assertEqual(unknown, [], f"exported but not found in {METRICS_SOURCE.name}")
        wrong = {f: (t, declared[f]) for f, t in ours.items() if declared[f] != t}
        self.assertEqual(wrong, {}, "scraped type vs declared type")
        self.assertGreaterEqual(len(declared), 25, declared)

    def test_documented_table_equals_the_exported_families(self):
        """Both directions: no family without a row, no row without a family,
        and the types agree."""
        declared = {f: t for f, t in declared_families().items() if f.startswith("memoffload_")}
        scraped = {f: t for f, t in exported_families(self.daemon.metrics()).items()
                   if f.startswith("memoffload_")}
        exported = {**declared, **scraped}
        documented = documented_families()
        where = DOC.relative_to(REPO)
        self.assertEqual(sorted(set(exported) - set(documented)), [],
                         f"exported but not in the table of {where}")
        self.assertEqual(sorted(set(documented) - set(exported)), [],
                         f"in the table of {where} but not exported")
        wrong = {f: (documented[f], t) for f, t in exported.items() if documented[f] != t}
        self.assertEqual(wrong, {}, f"type in {where} vs exported type")

    def test_provisioning_matches_the_documented_mounts(self):
        providers = yaml.safe_load((PROVISIONING / "dashboards" / "memoffload.yaml").read_text())
        paths = [p["options"]["path"] for p in providers["providers"]]
        self.assertEqual(paths, ["/var/lib/grafana/dashboards"])
        sources = yaml.safe_load((PROVISIONING / "datasources" / "memoffload.yaml").read_text())
        self.assertEqual([d["type"] for d in sources["datasources"]], ["prometheus"])
        doc = DOC.read_text()
        for mount in ("grafana/provisioning:/etc/grafana/provisioning",
                      "grafana/dashboards:/var/lib/grafana/dashboards"):
            self.assertIn(mount, doc)


class DashboardE2ETest(DaemonTestCase):
    def setUp(self):
        super().setUp()
        prometheus = shutil.which("prometheus")
        self.assertIsNotNone(prometheus, "prometheus not found (Debian package prometheus)")
        self.job = "memoffload"
        self.instance = self.daemon.metrics_address
        config = self.scratch / "prometheus.yml"
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": self.job, "scrape_interval": "1s",
                                "scrape_timeout": "1s",
                                "static_configs": [{"targets": [self.instance]}]}],
        }))
        for attempt in range(3):
            port = free_port()
            self.prom_url = f"http://127.0.0.1:{port}"
            self.prom_log = open(self.scratch / f"prometheus-{attempt}.log", "w")
            self.prom = subprocess.Popen(
                [prometheus, f"--config.file={config}",
                 f"--storage.tsdb.path={self.scratch / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                stdout=self.prom_log, stderr=subprocess.STDOUT)
            self.addCleanup(self.prom_log.close)
            self.addCleanup(stop, self.prom)
            try:
                wait_until(self._ready, 20, "prometheus to become ready")
                break
            except AssertionError:
                stop(self.prom)
                if attempt == 2:
                    raise AssertionError("prometheus did not start:\n" +
                                         (self.scratch / f"prometheus-{attempt}.log").read_text())

    def _ready(self):
        if self.prom.poll() is not None:
            raise AssertionError(f"prometheus exited with {self.prom.returncode}")
        try:
            return http_get(self.prom_url + "/-/ready", timeout=1) is not None
        except (urllib.error.URLError, ConnectionError, OSError):
            return False

    def query(self, expr: str, at: float) -> dict:
        url = self.prom_url + "/api/v1/query?" + urllib.parse.urlencode(
            {"query": expr, "time": f"{at:.3f}"})
        try:
            return json.loads(http_get(url))
        except urllib.error.HTTPError as e:
            return json.loads(e.read().decode())

    def scraped_since(self, t: float) -> bool:
        r = self.query(f'timestamp(memoffload_uptime_seconds{{job="{self.job}"}})', time.time())
        result = r.get("data", {}).get("result", [])
        return bool(result) and float(result[0]["value"][1]) > t

    def test_every_panel_query_returns_data(self):
        wait_until(lambda: self.scraped_since(time.time() - 0.5), 20, "a first scrape")
        self.drive_traffic(seconds=5)
        load_end = time.time()
        wait_until(lambda: self.scraped_since(load_end + 1), 20, "a scrape after the load")
        at = load_end + 1

        dashboard = load_dashboard()
        failures, checked = [], 0
        for p in data_panels(dashboard):
            for t in p["targets"]:
                expr = substitute(t["expr"], self.job, self.instance)
                r = self.query(expr, at)
                checked += 1
                where = f"panel {p['title']!r} query {t['refId']} `{expr}`"
                if r.get("status") != "success":
                    failures.append(f"{where}: {r.get('errorType')}: {r.get('error')}")
                    continue
                result = r["data"]["result"]
                values = [float(s["value"][1]) for s in result]
                if not values:
                    failures.append(f"{where}: no data")
                elif not any(math.isfinite(v) for v in values):
                    failures.append(f"{where}: only NaN/Inf ({values})")
        self.assertGreater(checked, 0)

        # The dashboard's variable queries, as Grafana runs them.
        for v in dashboard["templating"]["list"]:
            if v["type"] != "query":
                continue
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", q)
            if not m:
                failures.append(f"variable {v['name']}: cannot evaluate {q!r}")
                continue
            match = substitute(m.group(1), self.job, self.instance)
            url = self.prom_url + f"/api/v1/label/{m.group(2)}/values?" + urllib.parse.urlencode(
                {"match[]": match})
            got = json.loads(http_get(url)).get("data", [])
            want = {"job": self.job, "instance": self.instance}[v["name"]]
            if want not in got:
                failures.append(f"variable {v['name']}: {q!r} gave {got}, not {want!r}")

        # What the traffic did is visible through Prometheus.
        for expr in ('memoffload_reserve_rejections_total{reason="session_limit"} > 0',
                     "memoffload_sessions_reclaimed_total > 0",
                     "memoffload_group_residency_seconds_count > 0",
                     'memoffload_client_copy_seconds_total{direction="prefetch"} > 0'):
            r = self.query(f'{expr}', at)
            if not r.get("data", {}).get("result"):
                failures.append(f"`{expr}` is false at the end of the load")
        self.assertEqual(failures, [], f"{len(failures)} of {checked} panel queries failed:\n" +
                         "\n".join(failures))


def main():
    global BIN_DIR
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin-dir", default=str(BIN_DIR))
    args, rest = parser.parse_known_args()
    BIN_DIR = Path(args.bin_dir)
    unittest.main(argv=[sys.argv[0], "-v", *rest])


if __name__ == "__main__":
    main()
