#!/usr/bin/env python3
"""Runs memoffload-bench's allocator, startup and attach benchmarks (small
sizes) and checks their JSON lines: the fields issue 3 names, the packing
targets, and that every measured number is a positive number.

Timing targets (alloc+free p99, build/memset ratio, attach ms, first-write
ratio) are reported by the benchmarks, not asserted here: this machine is
shared and noisy. Usage: bench_test.py --bin-dir DIR [unittest args]."""
import argparse
import json
import math
import os
import subprocess
import sys
import unittest

BIN_DIR = None


def run_bench(*args, timeout=120):
    cmd = [os.path.join(BIN_DIR, "memoffload-bench"), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr}")
    rows = []
    for line in proc.stdout.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise AssertionError(f"{' '.join(cmd)}: not a JSON line ({e}): {line!r}")
    return rows


def positive_number(test, row, field):
    test.assertIn(field, row, f"{row.get('bench')} row lacks '{field}': {row}")
    value = row[field]
    test.assertIsInstance(value, (int, float), f"'{field}' is not a number: {row}")
    test.assertTrue(math.isfinite(value) and value > 0, f"'{field}' = {value!r}, expected > 0: {row}")
    return value


class AllocatorBench(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        rows = run_bench("allocator", "--json")
        cls.rows = [r for r in rows if r.get("bench") != "reserve_path"]
        cls.reserve_path = [r for r in rows if r.get("bench") == "reserve_path"]

    def unrestricted(self):
        rows = {r["trace"]: r for r in self.rows if not r.get("restricted", False)}
        self.assertEqual(sorted(rows), ["llama-70b-tp8", "llama-7b", "random"], self.rows)
        return rows

    def test_every_row_has_the_fields(self):
        self.assertTrue(self.rows)
        for row in self.rows:
            self.assertEqual(row.get("bench"), "allocator", row)
            self.assertIsInstance(row.get("restricted"), bool, row)
            for field in ("utilization", "pow2_utilization", "alloc_free_p50_ns",
                          "alloc_free_p99_ns", "requests", "extents_per_request",
                          "single_extent_utilization"):
                positive_number(self, row, field)
            self.assertLessEqual(row["alloc_free_p50_ns"], row["alloc_free_p99_ns"], row)
            self.assertGreaterEqual(row["extents_per_request"], 1.0, row)
            self.assertLessEqual(row["utilization"], 1.0, row)
            self.assertLessEqual(row["single_extent_utilization"], row["utilization"], row)

    def test_packing_targets(self):
        rows = self.unrestricted()
        for trace, target in (("llama-7b", 0.97), ("llama-70b-tp8", 0.97), ("random", 0.90)):
            row = rows[trace]
            self.assertGreaterEqual(row["utilization"], target,
                                    f"{trace}: utilization {row['utilization']} < target {target}")
            self.assertLess(row["pow2_utilization"], row["utilization"],
                            f"{trace}: the power-of-two model packs better than ours: {row}")

    def test_restricted_rows_for_every_trace(self):
        restricted = {r["trace"]: r for r in self.rows if r.get("restricted", False)}
        self.assertEqual(sorted(restricted), ["llama-70b-tp8", "llama-7b", "random"], self.rows)
        for row in restricted.values():
            self.assertGreaterEqual(positive_number(self, row, "tenants"), 2, row)
            # Same run, the old vector<bool> path: the same placement, so the
            # same utilisation; its latency is the baseline of the list's.
            for field in ("bitmap_utilization", "bitmap_alloc_free_p50_ns",
                          "bitmap_alloc_free_p99_ns", "bitmap_p50_ratio", "bitmap_p99_ratio"):
                positive_number(self, row, field)
            self.assertEqual(row["bitmap_utilization"], row["utilization"], row)

    def test_reserve_path_through_session_table(self):
        # Tenant-restricted Reserve+Release through SessionTable next to the
        # unrestricted one of the same run (issue 14: p99 <= 1 us, utilisation
        # unchanged); the ratios are reported, not asserted.
        self.assertEqual(len(self.reserve_path), 1, self.reserve_path)
        row = self.reserve_path[0]
        for field in ("arena_bytes", "chunks", "tenants", "samples", "restricted_p50_ns",
                      "restricted_p99_ns", "unrestricted_p50_ns", "unrestricted_p99_ns",
                      "p50_ratio", "p99_ratio", "p99_target_ns", "restricted_utilization",
                      "unrestricted_utilization", "utilization_ratio"):
            positive_number(self, row, field)
        self.assertGreaterEqual(row["tenants"], 2, row)
        for path in ("restricted", "unrestricted"):
            self.assertLessEqual(row[f"{path}_p50_ns"], row[f"{path}_p99_ns"], row)
            self.assertLessEqual(row[f"{path}_utilization"], 1.0, row)
        self.assertAlmostEqual(row["p99_ratio"],
                               row["restricted_p99_ns"] / row["unrestricted_p99_ns"], places=2)
        self.assertAlmostEqual(row["utilization_ratio"],
                               row["restricted_utilization"] / row["unrestricted_utilization"],
                               places=3)


class StartupBench(unittest.TestCase):
    def test_small_arena(self):
        rows = run_bench("startup", "--arena-size", "256MiB", "--json")
        self.assertEqual(len(rows), 1, rows)
        row = rows[0]
        self.assertEqual(row.get("bench"), "startup", row)
        self.assertEqual(row.get("arena_bytes"), 256 << 20, row)
        for field in ("build_gbps", "memset_gbps", "build_seconds", "ratio", "threads"):
            positive_number(self, row, field)
        self.assertIsInstance(row.get("mlocked"), bool, row)


class AttachBench(unittest.TestCase):
    def test_small_arena(self):
        rows = run_bench("attach", "--arena-size", "256MiB", "--json")
        self.assertEqual(len(rows), 1, rows)
        row = rows[0]
        self.assertEqual(row.get("bench"), "attach", row)
        self.assertEqual(row.get("arena_bytes"), 256 << 20, row)
        for field in ("attach_ms", "attach_p99_ms", "attach_floor_ms", "attach_floor_p99_ms",
                      "attach_floor_ratio", "first_write_gbps", "prefaulted_memcpy_gbps",
                      "fresh_private_write_gbps", "ratio", "write_bytes"):
            positive_number(self, row, field)
        self.assertGreaterEqual(row["attach_samples"], 100, row)
        self.assertLessEqual(row["attach_ms"], row["attach_p99_ms"], row)
        self.assertLessEqual(row["write_bytes"], row["arena_bytes"], row)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin-dir", required=True)
    args, rest = parser.parse_known_args()
    BIN_DIR = args.bin_dir
    unittest.main(argv=[sys.argv[0], *rest])
