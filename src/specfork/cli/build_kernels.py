"""``specfork build-kernels``: compile the native CPU kernels now, with progress."""

from __future__ import annotations

import argparse
import sys
import time

HELP = "compile the native CPU kernels now, with progress (install.sh runs it)"
DESCRIPTION = (
    "Compile specfork's native CPU kernels (quantised GEMM, paged attention, fused decoder "
    "layer) for this machine: about 2 minutes on 2 cores, once. The build is cached under "
    "~/.cache/specfork/kernels, keyed by the sources, the torch version, the compiler flags and the CPU, so "
    "a second install or any later run imports it at once. Without a C++ compiler specfork still "
    "runs, on slower PyTorch paths."
)


def run(args: argparse.Namespace) -> int:
    import threading

    from specfork import native_kernels

    library = native_kernels.library_path()
    if library.exists():
        print(f"native CPU kernels: already built for this torch and these sources ({library.parent})")
        return 0 if native_kernels.kernels() is not None else 1
    total = len(native_kernels.SOURCES)
    print(f"compiling the native CPU kernels: {total} C++ sources, about 2 minutes on 2 cores, once "
          f"(cached in {library.parent})", flush=True)
    start = time.perf_counter()
    result: list = []
    worker = threading.Thread(target=lambda: result.append(native_kernels.kernels()), daemon=True)
    worker.start()
    shown = -1
    while worker.is_alive():
        worker.join(timeout=15.0)
        done = native_kernels.compiled_sources(library.parent)
        if worker.is_alive() and (done != shown or int(time.perf_counter() - start) % 60 < 15):
            print(f"  {done}/{total} sources compiled, {time.perf_counter() - start:.0f} s", flush=True)
            shown = done
    if result and result[0] is not None:
        print(f"native CPU kernels built in {time.perf_counter() - start:.0f} s")
        return 0
    print("native CPU kernels could not be built (see the warning above); specfork will use slower "
          "PyTorch paths", file=sys.stderr)
    return 1
