"""Native CPU kernels, compiled once with ``torch.utils.cpp_extension`` (install.sh builds them
on the installing machine) and always optional: without a compiler the pure-PyTorch paths
run instead."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import time
from functools import cache
from pathlib import Path

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"


def build_directory() -> Path:
    return Path.home() / ".cache" / "specfork" / "kernels"


# -ffp-contract=off: no multiply-add is fused unless the code asks for it (__builtin_fmaf, FMA
# intrinsics), so element-wise arithmetic rounds exactly as the same PyTorch ops do.
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")
STALE_LOCK_S = 600.0  # a build takes a few minutes; an older lock was left by a killed build
SOURCES = ("small_m_gemm.cpp", "quant_gemm.cpp", "rms_norm.cpp", "paged_attention.cpp", "decoder_layer.cpp",
           "bindings.cpp")


@cache
def kernels():
    """The compiled kernel module, or None when it cannot be built here (no compiler, no headers, ...;
    every caller then runs an exact, slower PyTorch path).

    It is imported from a directory keyed by the sources, the torch version and the flags, building
    it first if needed. A finished build is imported directly, without torch's build lock: a process
    killed while holding that lock would otherwise leave every later process waiting on it forever."""
    try:
        import torch
        from torch.utils.cpp_extension import load

        files = [_CSRC / name for name in SOURCES] + [_CSRC / "kernels.h"]
        digest = hashlib.sha256(torch.__version__.encode() + repr(FLAGS).encode())
        for path in files:
            digest.update(path.name.encode() + path.read_bytes())
        directory = build_directory() / f"kernels-{digest.hexdigest()[:16]}"
        module_name = "specfork_kernels"
        library = directory / f"{module_name}.so"
        if library.exists():
            return _import(module_name, library)
        directory.mkdir(parents=True, exist_ok=True)
        lock = directory / "lock"
        if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink(missing_ok=True)
        return load(
            name=module_name,
            sources=[str(_CSRC / name) for name in SOURCES],
            build_directory=str(directory),
            extra_cflags=list(FLAGS),
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:
        logger.warning("native CPU kernels unavailable (%s); using PyTorch ops", e)
        return None


def _import(module_name: str, library: Path):
    spec = importlib.util.spec_from_file_location(module_name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    raise SystemExit(0 if kernels() is not None else 1)
