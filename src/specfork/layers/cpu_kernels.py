"""Native CPU kernels, compiled once with ``torch.utils.cpp_extension`` (install.sh builds them
on the installing machine) and always optional: without a compiler the pure-PyTorch paths
run instead."""

from __future__ import annotations

import logging
from functools import cache
from pathlib import Path

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "small_m_gemm.cpp"


def build_directory() -> Path:
    return Path.home() / ".cache" / "specfork" / "kernels"


@cache
def small_m_gemm():
    """The compiled module, or None when it cannot be built here (the caller falls back)."""
    try:
        from torch.utils.cpp_extension import load

        directory = build_directory()
        directory.mkdir(parents=True, exist_ok=True)
        return load(
            name="specfork_small_m_gemm",
            sources=[str(_SOURCE)],
            build_directory=str(directory),
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # no compiler, no headers, ...: the fallback is exact, only slower
        logger.warning("native small-M GEMM kernel unavailable (%s); using PyTorch matmul", e)
        return None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    module = small_m_gemm()
    raise SystemExit(0 if module is not None else 1)
