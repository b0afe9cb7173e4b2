#!/usr/bin/env python3
"""Runs bench/state_bench.py small (2 layers of hidden 256, one round) and
checks its JSON: both modes' figures are there and positive where they must
be, the two modes hold the same exact state, the arena holds it exactly but
for page rounding, the arena's bytes are counted once in node_bytes, and the
ratios are finite. The targets (held vs exact <= 1.01 at 200 M parameters)
are reported by the benchmark at full size, not asserted here. Usage:
state_bench_test.py --bin-dir DIR [unittest args], under the Python that has
memoffload installed."""
import math
import unittest

import python_bench


class StateBench(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.row = python_bench.run("state_bench.py", "--layers", "2", "--dim", "256",
                                   "--rounds", "1")[-1]

    def median(self, mode, key):
        return self.row[mode][key]["median"]

    def test_both_modes_hold_the_same_state(self):
        exact = self.median("torch", "state_bytes")
        self.assertGreater(exact, 0)
        self.assertEqual(self.median("arena_runs", "state_bytes"), exact)
        self.assertEqual(self.median("torch", "held_bytes"), exact)

    def test_the_arena_holds_it_exactly_but_for_page_rounding(self):
        exact = self.median("arena_runs", "state_bytes")
        held = self.median("arena_runs", "held_bytes")
        self.assertGreaterEqual(held, exact)
        self.assertLess(held, exact * 1.05)
        # The state is in the arena, counted once, not in the ranks' anonymous memory.
        self.assertGreaterEqual(self.median("arena_runs", "arena_used"), 0.9 * exact)
        self.assertEqual(self.median("torch", "arena_used"), 0)
        node = self.median("arena_runs", "node_bytes")
        self.assertEqual(node, self.median("arena_runs", "rss_anon")
                         + self.median("arena_runs", "arena_used"))

    def test_times_and_ratios_are_reported(self):
        for mode in ("torch", "arena_runs"):
            self.assertGreater(self.median(mode, "first_step_s"), 0)
        self.assertGreater(self.median("arena_runs", "place_s"), 0)
        for key, value in self.row["ratio_arena_over_torch"].items():
            self.assertTrue(math.isfinite(value) and value > 0, f"{key} = {value!r}")


if __name__ == "__main__":
    python_bench.main()
