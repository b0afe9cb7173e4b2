"""A rank that commits checkpoint regions in a loop until its daemon goes
away (test_restart.py): each region's bytes follow from its name, and its
name is written to the output file only once the commit was answered."""

import hashlib
import sys

import torch  # noqa: F401  (loads libtorch for memoffload._C)

from memoffload import _C

SIZE = 192 << 10


def content(name: str) -> bytes:
    block = hashlib.sha256(name.encode()).digest()
    return (block * (SIZE // len(block) + 1))[:SIZE - 7]


def main() -> None:
    runtime_dir, job, prefix, out = sys.argv[1:5]
    store = _C.RegionStore(runtime_dir=runtime_dir, job_id=job, rank=0)
    with open(out, "a") as log:
        print("ready", file=log, flush=True)
        for i in range(100000):
            name = f"{prefix}-{i}"
            try:
                w = store.create(name, SIZE)
                w.append(content(name))
                w.commit()
            except Exception as exc:  # the daemon was killed: stop
                print(f"stopped: {type(exc).__name__}", file=log, flush=True)
                return
            print(name, file=log, flush=True)
            if i >= 20:  # keep the arena from filling: delete as we go
                print(f"deleting {prefix}-{i - 20}", file=log, flush=True)
                try:
                    store.delete(f"{prefix}-{i - 20}")
                except Exception as exc:
                    print(f"stopped: {type(exc).__name__}", file=log, flush=True)
                    return


if __name__ == "__main__":
    main()
