#!/usr/bin/env python3
"""Builds memoffload._C on the machine the GPU kit landed on, against the
torch of the Python that runs this script, with torch's own extension
builder (torch.utils.cpp_extension: ninja, every core, the compiler flags
and C++ ABI of that torch, no CUDA toolkit needed: the CUDA engine dlopens
libcuda.so.1 at run time).

    python3 build_c.py --kit KIT --work WORK

Sources: KIT/src/torch (the torch layer and its Python bindings, as in
client/torch), headers KIT/include, linked against KIT/lib/libmemoffload_client.so
(the client, gRPC and protobuf inside, found at run time through RUNPATH).
The module lands in WORK/python/memoffload/ beside a copy of the package's
Python sources, and is imported once to prove that it loads. Prints one JSON
line: what was built, against which torch, in how many seconds.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kit", required=True)
    parser.add_argument("--work", required=True)
    args = parser.parse_args()
    kit, work = os.path.abspath(args.kit), os.path.abspath(args.work)

    import torch
    from torch.utils import cpp_extension

    if not torch.compiled_with_cxx11_abi():
        print(f"build_c: torch {torch.__version__} is built with the old C++ ABI "
              "(_GLIBCXX_USE_CXX11_ABI=0); the kit's libmemoffload_client.so uses the new one",
              file=sys.stderr)
        return 1
    src = os.path.join(kit, "src", "torch")
    sources = sorted(glob.glob(os.path.join(src, "*.cc")) + glob.glob(os.path.join(src, "src", "*.cc")))
    if not sources:
        print(f"build_c: no sources under {src}", file=sys.stderr)
        return 1
    build_dir = os.path.join(work, "build")
    package = os.path.join(work, "python", "memoffload")
    shutil.rmtree(package, ignore_errors=True)
    shutil.copytree(os.path.join(kit, "python", "memoffload"), package)
    os.makedirs(build_dir, exist_ok=True)
    lib = os.path.join(kit, "lib")
    version = torch.__version__.split("+")[0]
    start = time.monotonic()
    cpp_extension.load(
        name="_C",
        sources=sources,
        extra_include_paths=[os.path.join(kit, "include"), src],
        # The quotes must survive the shell that ninja runs the compiler in.
        extra_cflags=["-O2", "-fvisibility=hidden",
                      '-DMEMOFFLOAD_BUILT_TORCH_VERSION=\\"' + version + '\\"'],
        extra_ldflags=[f"-L{lib}", "-lmemoffload_client", f"-Wl,-rpath,{lib}"],
        build_directory=build_dir,
        verbose=True,
        with_cuda=False,
        # Loaded with dlopen only: the import that counts is memoffload._C below
        # (a second PyInit of the same bindings would register its types twice).
        is_python_module=False,
    )
    seconds = time.monotonic() - start
    built = os.path.join(build_dir, "_C.so")
    shutil.copy2(built, os.path.join(package, "_C.so"))
    # The copy in the package must load as memoffload._C, with its libraries,
    # in a fresh interpreter (this one has loaded the build's copy), after
    # torch (whose libraries it links), as memoffload.torch imports it.
    env = dict(os.environ, PYTHONPATH=os.path.dirname(package))
    check = subprocess.run([sys.executable, "-c", "import torch, memoffload._C as c; print(c.__file__)"],
                           env=env, capture_output=True, text=True)
    if check.returncode != 0 or os.path.realpath(check.stdout.strip()) != os.path.realpath(
            os.path.join(package, "_C.so")):
        print(f"build_c: memoffload._C does not import from {package}:\n{check.stdout}{check.stderr}",
              file=sys.stderr)
        return 1

    print(json.dumps({"step": "build_info", "sources": len(sources), "seconds": round(seconds, 1),
                      "torch": torch.__version__, "python": sys.version.split()[0],
                      "jobs": os.environ.get("MAX_JOBS", str(os.cpu_count())),
                      "module": os.path.join(package, "_C.so")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
