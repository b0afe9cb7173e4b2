"""The arena on each page size this machine allows (issue 43).

    python3 bench/page_sizes_bench.py [--arena-size 2GiB] [--rounds 5] [--json]

For each page size it runs ``memoffload-bench attach`` (a fresh client's
first write into the arena, the page-table fill inside the timed window,
against a memcpy into pre-faulted private memory in the same run) and
``memoffload-bench startup`` (the arena's build against a parallel memset of
fresh memory, same run):

- ``4k``: shared-memory THP off (``shmem_enabled`` ``never``) for the run;
- ``thp``: ``shmem_enabled`` ``advise`` for the run (what docs/deploy.md asks
  operators to set);
- ``hugetlbfs``: ``vm.nr_hugepages`` raised to the arena's size for the run,
  the daemon started with ``--hugepages``.

The settings are changed through bench/sysknobs.py, which restores them on
every exit path and undoes what a killed run left. Rounds interleave the
page sizes; each figure is the median over rounds with its range. A page
size the machine does not allow (no root, no such setting, too few huge
pages) is reported as such, never measured on another.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sysknobs  # noqa: E402

HUGE = 2 << 20


def parse_size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for suffix, mult in units.items():
        if text.endswith(suffix):
            return int(float(text[:-len(suffix)]) * mult)
    return int(text)


def bench_binary() -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    bin_dir = os.environ.get("MEMOFFLOAD_BIN_DIR", os.path.join(root, "build", "bin"))
    return os.path.join(bin_dir, "memoffload-bench")


def settings(kind: str, arena: int) -> Dict[str, str]:
    if kind == "4k":
        return {sysknobs.THP: "never", sysknobs.THP_2M: "inherit"}
    if kind == "thp":
        return {sysknobs.THP: "advise", sysknobs.THP_2M: "inherit"}
    # hugetlbfs: the arena's pages and a few spare, THP off so that only
    # the reservation decides.
    return {sysknobs.NR_HUGEPAGES: str(arena // HUGE + 8), sysknobs.THP: "never"}


def unavailable(kind: str, arena: int) -> str:
    """Why this machine cannot run ``kind``, or ""."""
    paths = list(settings(kind, arena))
    missing = [p for p in paths if not sysknobs.writable(p)]
    if missing:
        return f"cannot set {', '.join(missing)} (needs root and a kernel with it)"
    return ""


def run(binary: str, args: List[str]) -> dict:
    out = subprocess.run([binary, *args, "--json"], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def one_round(binary: str, kind: str, arena: int, size: str) -> Dict[str, dict]:
    huge = ["--hugepages"] if kind == "hugetlbfs" else []
    with sysknobs.changed(settings(kind, arena)) as got:
        if kind == "hugetlbfs" and int(got.get(sysknobs.NR_HUGEPAGES, "0")) < arena // HUGE:
            raise RuntimeError(f"the kernel reserved only {got[sysknobs.NR_HUGEPAGES]} huge pages "
                               f"of the {arena // HUGE} asked (memory too fragmented)")
        attach = run(binary, ["attach", "--arena-size", size, *huge])
        startup = run(binary, ["startup", "--arena-size", size, *huge])
    return {"attach": attach, "startup": startup}


def spread(values: List[float]) -> Dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arena-size", default="2GiB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--kinds", default="4k,thp,hugetlbfs")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    arena = parse_size(args.arena_size)
    binary = bench_binary()
    left = sysknobs.restore_leftovers()
    if left:
        print(f"restored settings a killed run left: {'; '.join(left)}", file=sys.stderr)
    kinds = args.kinds.split(",")
    results: Dict[str, Dict[str, List[dict]]] = {k: {"attach": [], "startup": []} for k in kinds}
    skipped: Dict[str, str] = {}
    for kind in kinds:
        why = unavailable(kind, arena)
        if why:
            skipped[kind] = why
    for _ in range(args.rounds):
        for kind in kinds:
            if kind in skipped:
                continue
            try:
                r = one_round(binary, kind, arena, args.arena_size)
            except RuntimeError as e:
                skipped[kind] = str(e)
                continue
            results[kind]["attach"].append(r["attach"])
            results[kind]["startup"].append(r["startup"])
    report = {"arena_bytes": arena, "rounds": args.rounds, "kinds": {}, "skipped": skipped}
    for kind in kinds:
        a, s = results[kind]["attach"], results[kind]["startup"]
        if not a or kind in skipped:
            continue
        report["kinds"][kind] = {
            "pages": sorted({x["pages"] for x in a} | {x["pages"] for x in s}),
            "first_write_ratio": spread([x["ratio"] for x in a]),
            "first_write_gbps": spread([x["first_write_gbps"] for x in a]),
            "prefaulted_memcpy_gbps": spread([x["prefaulted_memcpy_gbps"] for x in a]),
            "startup_ratio": spread([x["ratio"] for x in s]),
            "startup_gbps": spread([x["build_gbps"] for x in s]),
        }
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"arena {args.arena_size}, {args.rounds} rounds (median, min-max)")
    for kind, r in report["kinds"].items():
        fw, st = r["first_write_ratio"], r["startup_ratio"]
        print(f"{kind:9s} on {', '.join(r['pages'])}: first write {fw['median']:.2f}x the "
              f"pre-faulted memcpy ({fw['min']:.2f}-{fw['max']:.2f}; "
              f"{r['first_write_gbps']['median']:.2f} GB/s against "
              f"{r['prefaulted_memcpy_gbps']['median']:.2f}); start-up build {st['median']:.2f}x "
              f"a fresh memset ({st['min']:.2f}-{st['max']:.2f}; "
              f"{r['startup_gbps']['median']:.2f} GB/s)")
    for kind, why in skipped.items():
        print(f"{kind:9s} not measured: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
