"""Native CPU kernels, compiled once with ``torch.utils.cpp_extension`` (install.sh builds them
on the installing machine) and always optional: without a compiler the pure-PyTorch paths
run instead."""

from __future__ import annotations

import logging
from functools import cache
from pathlib import Path

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"


def build_directory() -> Path:
    return Path.home() / ".cache" / "specfork" / "kernels"


def _build(name: str, source: str, fallback: str):
    try:
        from torch.utils.cpp_extension import load

        directory = build_directory() / name
        directory.mkdir(parents=True, exist_ok=True)
        return load(
            name=f"specfork_{name}",
            sources=[str(_CSRC / source)],
            build_directory=str(directory),
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # no compiler, no headers, ...: the fallback is exact, only slower
        logger.warning("native kernel %s unavailable (%s); using %s", name, e, fallback)
        return None


@cache
def small_m_gemm():
    """The compiled small-M GEMM module, or None when it cannot be built here."""
    return _build("small_m_gemm", "small_m_gemm.cpp", "PyTorch matmul")


@cache
def paged_attention():
    """The compiled paged-attention module, or None when it cannot be built here."""
    return _build("paged_attention", "paged_attention.cpp", "gather + SDPA attention")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    built = [small_m_gemm(), paged_attention()]
    raise SystemExit(0 if all(m is not None for m in built) else 1)
