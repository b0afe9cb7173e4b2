"""What the tests of the Python benchmarks share: run ``bench/<script>``
under this Python with ``MEMOFFLOAD_BIN_DIR`` (``--bin-dir``), return its
JSON lines; and their command line (``<test>.py --bin-dir DIR [unittest
args]``)."""
import argparse
import json
import os
import subprocess
import sys
import unittest
from typing import List

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
BIN_DIR = None


def run(script: str, *args: str, timeout: int = 300) -> List[dict]:
    """Every JSON line ``bench/<script> args`` printed; AssertionError with
    its stderr when it fails."""
    cmd = [sys.executable, os.path.join(REPO, "bench", script), *args]
    env = dict(os.environ, MEMOFFLOAD_BIN_DIR=BIN_DIR)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def main() -> None:
    global BIN_DIR
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin-dir", required=True)
    args, rest = parser.parse_known_args()
    BIN_DIR = args.bin_dir
    unittest.main(module="__main__", argv=[sys.argv[0], *rest])
