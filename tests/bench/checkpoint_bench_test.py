#!/usr/bin/env python3
"""Runs bench/checkpoint_bench.py small (64 MiB, one counted round) and checks
its JSON: every save and load figure through the daemon next to its same-run
baselines (memcpy, DCP's FileSystemWriter/Reader cold and warm), and their
ratios, each a positive number; the disk it wrote to is not tmpfs, and the
cold load's page-cache state is reported.

The goals (save >= 0.5x memcpy, restore >= 5x a cold disk read) are reported
by the benchmark, not asserted: this machine is shared and noisy. Usage:
checkpoint_bench_test.py --bin-dir DIR [unittest args], under the Python that
has memoffload installed."""
import argparse
import json
import math
import os
import subprocess
import sys
import unittest

BIN_DIR = None
REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
SAVE_FIELDS = ("memcpy_gbps", "daemon_crc_gbps", "daemon_nocrc_gbps", "filesystem_gbps",
               "daemon_crc_vs_memcpy", "daemon_nocrc_vs_memcpy", "daemon_crc_vs_filesystem",
               "daemon_crc_first_gbps", "daemon_crc_first_vs_memcpy")
LOAD_FIELDS = ("memcpy_gbps", "daemon_crc_gbps", "daemon_nocrc_gbps", "filesystem_cold_gbps",
               "filesystem_warm_gbps", "daemon_crc_vs_filesystem_cold", "daemon_crc_vs_filesystem_warm",
               "daemon_crc_vs_memcpy")


class CheckpointBench(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cmd = [sys.executable, os.path.join(REPO, "bench", "checkpoint_bench.py"),
               "--size", "64MiB", "--repeat", "1"]
        env = dict(os.environ, MEMOFFLOAD_BIN_DIR=BIN_DIR)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        if proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr}")
        cls.row = json.loads(proc.stdout.strip().splitlines()[-1])

    def check_positive(self, section, fields):
        for field in fields:
            value = self.row[section].get(field)
            self.assertIsInstance(value, (int, float), f"{section}.{field}: {self.row}")
            self.assertTrue(math.isfinite(value) and value > 0, f"{section}.{field} = {value!r}")

    def test_save_figures_and_ratios(self):
        self.check_positive("save", SAVE_FIELDS)

    def test_load_figures_and_ratios(self):
        self.check_positive("load", LOAD_FIELDS)

    def test_disk_and_page_cache_state_are_reported(self):
        disk = self.row["disk"]
        self.assertNotIn(disk["fstype"], ("tmpfs", "ramfs"), disk)
        self.assertIn("POSIX_FADV_DONTNEED", disk["cold_method"])
        self.assertEqual(len(disk["resident_bytes_before_cold_load"]), 1, disk)  # --repeat 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin-dir", required=True)
    args, rest = parser.parse_known_args()
    BIN_DIR = args.bin_dir
    unittest.main(argv=[sys.argv[0], *rest])
