#!/usr/bin/env python3
"""Runs bench/torch_bench.py's hooks bench (few rounds, no step benches) and
checks its JSON: for every tensor size (4 KiB to 16 MiB), with the group's
reservation made at its begin and ahead of it, the p50 per tensor of
memoffload's pack + unpack, the clone-only hook's measured in the same run,
their ratio and the per-group time, each a positive number, and the share of
copies the training thread made.

The 1.5x target on the ratio is reported by the benchmark, not asserted here:
this machine is shared and noisy. Usage: torch_bench_test.py --bin-dir DIR
[unittest args], under the Python that has memoffload installed."""
import argparse
import json
import math
import os
import subprocess
import sys
import unittest

BIN_DIR = None
REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
SIZES = (4096, 65536, 1 << 20, 16 << 20)


class TorchHooksBench(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cmd = [sys.executable, os.path.join(REPO, "bench", "torch_bench.py"), "--no-step",
               "--rounds", "3", "--sizes", ",".join(str(s) for s in SIZES)]
        env = dict(os.environ, MEMOFFLOAD_BIN_DIR=BIN_DIR)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        if proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr}")
        cls.rows = []
        for line in proc.stdout.splitlines():
            if line.strip():
                cls.rows.append(json.loads(line))

    def test_every_size_has_the_ratio(self):
        hooks = [r for r in self.rows if r.get("bench") == "hooks"]
        seen = sorted((r.get("tensor_bytes"), r.get("reservation")) for r in hooks)
        self.assertEqual(seen, sorted((s, m) for s in SIZES for m in ("ahead", "at_begin")),
                         self.rows)
        for row in hooks:
            for field in ("memoffload_p50_us_per_tensor", "clone_p50_us_per_tensor",
                          "ratio_vs_clone", "group_p50_us", "tensors_per_group"):
                self.assertIn(field, row, f"row lacks '{field}': {row}")
                value = row[field]
                self.assertIsInstance(value, (int, float), row)
                self.assertTrue(math.isfinite(value) and value > 0, f"'{field}' = {value!r}: {row}")
            fraction = row.get("caller_copy_fraction")
            self.assertIsInstance(fraction, (int, float), row)
            self.assertTrue(0 <= fraction <= 1, row)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin-dir", required=True)
    args, rest = parser.parse_known_args()
    BIN_DIR = args.bin_dir
    unittest.main(argv=[sys.argv[0], *rest])
