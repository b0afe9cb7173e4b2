#!/usr/bin/python3
"""64-client load against the real memoffloadd, next to the plain gRPC floor.

  load_test.py --bin-dir DIR [--clients N] [--seconds S] [--pairs N]

Starts a daemon in a temporary runtime dir, runs
`memoffload-bench load --clients 64 --seconds 5 --baseline --pairs 3 --json` and checks:
exit 0; no error, write error, verify failure or failed worker; every method
and the floor report ops and latency percentiles; the floor saw no error;
the CPU per call of clients (their copies apart) and server is reported for
both phases, with its ratio per pair. A second, short run with --warm and
--floor-copies checks the warm-up claimed every chunk and the floor's clients
copied. A third, with --no-copies, checks that neither side copied and
every cycle still went through (the request path next to the plain floor).
Then checks the daemon exits cleanly with 0 and logged no WARN or ERROR line
(this load kills no client, so none is expected). Standard library only.
"""

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path

ARGS = None
METHODS = ("Reserve", "Commit", "Prefetch", "Release")


class LoadTest(unittest.TestCase):
    def setUp(self):
        self.bin = Path(ARGS.bin_dir)
        for tool in ("memoffloadd", "memoffloadctl", "memoffload-bench"):
            self.assertTrue((self.bin / tool).is_file(), f"{self.bin / tool} is not built")
        self.scratch = Path(tempfile.mkdtemp(prefix="memoffload-load-"))
        self.addCleanup(shutil.rmtree, self.scratch, ignore_errors=True)
        self.runtime_dir = self.scratch / "rt"
        self.log_path = self.scratch / "memoffloadd.log"
        log = open(self.log_path, "w")
        self.addCleanup(log.close)
        self.daemon = subprocess.Popen(
            [str(self.bin / "memoffloadd"), "--runtime-dir", str(self.runtime_dir),
             "--arena-size", "512MiB", "--chunk-size", "64MiB", "--metrics-address", "none",
             "--drain-timeout", "2s"],
            stdout=log, stderr=subprocess.STDOUT)
        self.addCleanup(self._kill_daemon)
        deadline = time.monotonic() + 30
        while True:
            self.assertIsNone(self.daemon.poll(), "memoffloadd exited:\n" + self.log())
            r = subprocess.run([str(self.bin / "memoffloadctl"), "--runtime-dir",
                                str(self.runtime_dir), "--json", "status"],
                               capture_output=True, text=True, timeout=10)
            if r.returncode == 0:
                break
            self.assertLess(time.monotonic(), deadline, "memoffloadd did not come up:\n" +
                            self.log())
            time.sleep(0.1)

    def _kill_daemon(self):
        if self.daemon.poll() is None:
            self.daemon.kill()
            self.daemon.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def test_64_clients_have_no_errors_and_report_percentiles_next_to_the_floor(self):
        seconds = ARGS.seconds
        argv = [str(self.bin / "memoffload-bench"), "load", "--runtime-dir",
                str(self.runtime_dir), "--clients", str(ARGS.clients), "--seconds", str(seconds),
                "--max-group", "256KiB", "--baseline", "--pairs", str(ARGS.pairs), "--json"]
        r = subprocess.run(argv, capture_output=True, text=True,
                           timeout=4 * seconds * ARGS.pairs + 240)
        output = f"{' '.join(argv)} exited {r.returncode}\n{r.stdout}\n{r.stderr}"
        self.assertEqual(r.returncode, 0, output)
        lines = [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{")]
        summary = [l for l in lines if l.get("summary")]
        self.assertEqual(len(summary), 1, output)
        summary = summary[0]
        for key in ("errors", "verify_failures", "write_errors", "failed_workers"):
            self.assertEqual(summary[key], 0, f"{key}: {output}")
        self.assertIs(summary["floor_ok"], True, output)
        self.assertEqual(summary["clients"], ARGS.clients)
        self.assertGreater(summary["cycles"], 0, output)

        by_method = {l["method"]: l for l in lines if "ops" in l and "method" in l}
        for method in METHODS + ("grpc_floor",):
            self.assertIn(method, by_method, output)
            m = by_method[method]
            self.assertEqual(m["errors"], 0, f"{method}: {m}")
            self.assertGreater(m["ops"], 0, f"{method}: {m}")
            for p in ("p50_us", "p90_us", "p99_us"):
                self.assertGreater(m[p], 0, f"{method} {p}: {m}")
            self.assertLessEqual(m["p50_us"], m["p99_us"], f"{method}: {m}")
        ratios = {l["method"]: l for l in lines if "p50_vs_floor" in l}
        self.assertEqual(set(ratios), set(METHODS), output)
        for method, r in ratios.items():  # medians over the pairs, with their spread
            self.assertEqual(r["pairs"], ARGS.pairs, r)
            for q in ("p50", "p99"):
                lo, mid, hi = (r[f"{q}_vs_floor_min"], r[f"{q}_vs_floor"],
                               r[f"{q}_vs_floor_max"])
                self.assertTrue(0 < lo <= mid <= hi, f"{method} {q}: {r}")
        # Where the CPU went: clients (their copies a part) and server, per
        # call, for the daemon's phases and the floor's; and its ratio.
        cpu = {l["cpu"]: l for l in lines if "cpu" in l}
        self.assertEqual(set(cpu), {"daemon", "floor"}, output)
        for what, c in cpu.items():
            self.assertGreater(c["calls"], 0, c)
            self.assertGreater(c["client_us_per_call"], c["client_copy_us_per_call"], c)
            self.assertIsNotNone(c["server_us_per_call"], f"server CPU unread: {c}")
            self.assertGreater(c["server_us_per_call"], 0, c)
        self.assertGreater(cpu["daemon"]["client_copy_us_per_call"], 0, output)
        self.assertEqual(cpu["floor"]["client_copy_us_per_call"], 0, output)  # a plain floor
        [ratio] = [l for l in lines if "cpu_per_call_vs_floor" in l]
        self.assertTrue(0 < ratio["cpu_per_call_vs_floor_min"] <= ratio["cpu_per_call_vs_floor"]
                        <= ratio["cpu_per_call_vs_floor_max"], ratio)
        self.assertEqual([l for l in lines if l.get("warmup")], [], output)  # no --warm
        print(json.dumps({"summary": summary,
                          "p50_us": {k: by_method[k]["p50_us"] for k in by_method},
                          "p99_us": {k: by_method[k]["p99_us"] for k in by_method}}))

        # Nothing left held, a clean exit, and nothing worth a WARN or ERROR.
        st = json.loads(subprocess.run(
            [str(self.bin / "memoffloadctl"), "--runtime-dir", str(self.runtime_dir), "--json",
             "status"], capture_output=True, text=True, timeout=10).stdout)
        self.assertEqual(int(st.get("groups", 0)), 0, st)
        self.daemon.send_signal(signal.SIGTERM)
        self.assertEqual(self.daemon.wait(15), 0, self.log())
        bad = [l for l in self.log().splitlines() if "] ERROR " in l or "] WARN " in l
               if "mlock failed" not in l]
        self.assertEqual(bad, [], self.log())

    def test_warm_clients_next_to_a_floor_doing_the_same_copies(self):
        argv = [str(self.bin / "memoffload-bench"), "load", "--runtime-dir",
                str(self.runtime_dir), "--clients", "8", "--seconds", "2", "--max-group",
                "256KiB", "--baseline", "--floor-copies", "--warm", "--json"]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        output = f"{' '.join(argv)} exited {r.returncode}\n{r.stdout}\n{r.stderr}"
        self.assertEqual(r.returncode, 0, output)
        lines = [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{")]
        # --warm: every chunk was claimed for the bench's tenant first, for
        # the clients to populate at attach.
        [warm] = [l for l in lines if l.get("warmup")]
        self.assertEqual(warm["claimed_chunks"], warm["chunks"], warm)
        self.assertEqual(warm["chunks"], 8, warm)  # 512 MiB in 64 MiB chunks
        [floor] = [l for l in lines if l.get("method") == "grpc_floor"]
        self.assertIs(floor["floor_copies"], True, floor)
        self.assertEqual(floor["errors"], 0, floor)  # its read-backs compared equal
        cpu = {l["cpu"]: l for l in lines if "cpu" in l}
        for what in ("daemon", "floor"):
            self.assertGreater(cpu[what]["client_copy_us_per_call"], 0, cpu)
        [summary] = [l for l in lines if l.get("summary")]
        self.assertEqual(summary["errors"], 0, output)

    def test_the_request_path_alone_next_to_the_plain_floor(self):
        argv = [str(self.bin / "memoffload-bench"), "load", "--runtime-dir",
                str(self.runtime_dir), "--clients", "8", "--seconds", "2", "--max-group",
                "256KiB", "--baseline", "--no-copies", "--json"]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        output = f"{' '.join(argv)} exited {r.returncode}\n{r.stdout}\n{r.stderr}"
        self.assertEqual(r.returncode, 0, output)
        lines = [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{")]
        [summary] = [l for l in lines if l.get("summary")]
        self.assertIs(summary["copies"], False, summary)
        for key in ("errors", "verify_failures", "write_errors", "failed_workers"):
            self.assertEqual(summary[key], 0, f"{key}: {output}")
        self.assertGreater(summary["offloaded_bytes"], 0, summary)  # groups went through
        cpu = {l["cpu"]: l for l in lines if "cpu" in l}
        self.assertEqual(set(cpu), {"daemon", "floor"}, output)
        for what in ("daemon", "floor"):  # neither side copied
            self.assertEqual(cpu[what]["client_copy_us_per_call"], 0, cpu)
            self.assertGreater(cpu[what]["client_us_per_call"], 0, cpu)
        ratios = {l["method"]: l for l in lines if "p99_vs_floor" in l}
        self.assertEqual(set(ratios), set(METHODS), output)
        [floor] = [l for l in lines if l.get("method") == "grpc_floor"]
        self.assertIs(floor["floor_copies"], False, floor)
        # A floor that copies next to clients that do not compares nothing.
        bad = subprocess.run(argv + ["--floor-copies"], capture_output=True, text=True,
                             timeout=30)
        self.assertEqual(bad.returncode, 2, bad.stderr)
        self.assertIn("--no-copies and --floor-copies", bad.stderr)


def main():
    global ARGS
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin-dir", required=True)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--pairs", type=int, default=3)
    ARGS, rest = parser.parse_known_args()
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)


if __name__ == "__main__":
    main()
