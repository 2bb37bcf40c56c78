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
MODULE_NAME = "specfork_kernels"
SOURCES = ("small_m_gemm.cpp", "quant_gemm.cpp", "rms_norm.cpp", "activation.cpp", "paged_attention.cpp",
           "decoder_layer.cpp", "sampling.cpp", "bindings.cpp")


def keyed_directory() -> Path:
    """Where the build for these sources, this torch and these flags lives (a cache: a second
    install, or any later process, imports it without compiling)."""
    import torch

    digest = hashlib.sha256(torch.__version__.encode() + repr(FLAGS).encode())
    for path in [_CSRC / name for name in SOURCES] + sorted(_CSRC.glob("*.h")) + sorted(_CSRC.glob("*.inc")):
        digest.update(path.name.encode() + path.read_bytes())
    return build_directory() / f"kernels-{digest.hexdigest()[:16]}"


def library_path() -> Path:
    return keyed_directory() / f"{MODULE_NAME}.so"


def compiled_sources(directory: Path) -> int:
    """How many sources of a build in progress are compiled (ninja writes one object each)."""
    return len(list(directory.glob("*.o")))


@cache
def kernels():
    """The compiled kernel module, or None when it cannot be built here (no compiler, no headers, ...;
    every caller then runs an exact, slower PyTorch path).

    It is imported from a directory keyed by the sources, the torch version and the flags, building
    it first if needed. A finished build is imported directly, without torch's build lock: a process
    killed while holding that lock would otherwise leave every later process waiting on it forever."""
    try:
        from torch.utils.cpp_extension import load

        directory = keyed_directory()
        library = directory / f"{MODULE_NAME}.so"
        if library.exists():
            return _import(MODULE_NAME, library)
        directory.mkdir(parents=True, exist_ok=True)
        lock = directory / "lock"
        if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink(missing_ok=True)
        logger.info("compiling the native CPU kernels in %s (a few minutes, once)", directory)
        return load(
            name=MODULE_NAME,
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


def instruction_set() -> str:
    """The instruction set the native quantised kernels use on this CPU (the best it runs), or
    "none (PyTorch ops)" without native kernels."""
    k = kernels()
    return "none (PyTorch ops)" if k is None else k.kernel_isa()
