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


FLAGS = ("-O3", "-march=native", "-fopenmp")
STALE_LOCK_S = 600.0  # a build takes about a minute; an older lock was left by a killed build


def _build(name: str, source: str, fallback: str):
    """Import the kernel built for exactly this source, torch version and flags, building it first
    if needed. A finished build is imported directly, without torch's build lock: a process killed
    while holding that lock would otherwise leave every later process waiting on it forever."""
    try:
        import torch
        from torch.utils.cpp_extension import load

        code = (_CSRC / source).read_bytes()
        key = hashlib.sha256(code + torch.__version__.encode() + repr(FLAGS).encode()).hexdigest()[:16]
        directory = build_directory() / f"{name}-{key}"
        module_name = f"specfork_{name}"
        library = directory / f"{module_name}.so"
        if library.exists():
            return _import(module_name, library)
        directory.mkdir(parents=True, exist_ok=True)
        lock = directory / "lock"
        if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink(missing_ok=True)
        return load(
            name=module_name,
            sources=[str(_CSRC / source)],
            build_directory=str(directory),
            extra_cflags=list(FLAGS),
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # no compiler, no headers, ...: the fallback is exact, only slower
        logger.warning("native kernel %s unavailable (%s); using %s", name, e, fallback)
        return None


def _import(module_name: str, library: Path):
    spec = importlib.util.spec_from_file_location(module_name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@cache
def small_m_gemm():
    """The compiled small-M GEMM module, or None when it cannot be built here."""
    return _build("small_m_gemm", "small_m_gemm.cpp", "PyTorch matmul")


@cache
def quant_gemm():
    """The compiled block-quantised (Q4/Q8) GEMM module, or None when it cannot be built here."""
    return _build("quant_gemm", "quant_gemm.cpp", "dequantised float32 weights")


@cache
def rms_norm():
    """The compiled RMSNorm module, or None when it cannot be built here."""
    return _build("rms_norm", "rms_norm.cpp", "PyTorch ops")


@cache
def paged_attention():
    """The compiled paged-attention module, or None when it cannot be built here."""
    return _build("paged_attention", "paged_attention.cpp", "gather + SDPA attention")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    built = [small_m_gemm(), paged_attention(), quant_gemm(), rms_norm()]
    raise SystemExit(0 if all(m is not None for m in built) else 1)
