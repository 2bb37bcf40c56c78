"""Native CPU kernels, compiled once with ``torch.utils.cpp_extension`` (install.sh builds them
on the installing machine) and always optional: without a compiler the pure-PyTorch paths
run instead."""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
from contextlib import contextmanager
from functools import cache
from pathlib import Path

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"


def build_directory() -> Path:
    return Path.home() / ".cache" / "specfork" / "kernels"


# -ffp-contract=off: no multiply-add is fused unless the code asks for it (__builtin_fmaf, FMA
# intrinsics), so element-wise arithmetic rounds exactly as the same PyTorch ops do.
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")
MODULE_NAME = "specfork_kernels"
SOURCES = ("small_m_gemm.cpp", "quant_gemm.cpp", "rms_norm.cpp", "activation.cpp", "paged_attention.cpp",
           "decoder_layer.cpp", "sampling.cpp", "logit_adjustments.cpp", "bindings.cpp")


def keyed_directory() -> Path:
    """Where the build for these sources, this torch, these flags and this CPU lives (a cache: a
    second install, or any later process, imports it without compiling). -march=native compiles
    for the building CPU, so the CPU's instruction sets are part of the key: a cache shared with
    another machine (a network home, a container image) builds anew rather than loading code its
    CPU may not run."""
    import torch

    digest = hashlib.sha256(torch.__version__.encode() + repr(FLAGS).encode() + cpu_identity().encode())
    for path in [_CSRC / name for name in SOURCES] + sorted(_CSRC.glob("*.h")) + sorted(_CSRC.glob("*.inc")):
        digest.update(path.name.encode() + path.read_bytes())
    return build_directory() / f"kernels-{digest.hexdigest()[:16]}"


def cpu_identity() -> str:
    """The CPU's model and instruction-set flags as the kernel reports them (Linux), else the
    platform's processor name."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform

        return platform.processor() or platform.machine()
    fields = {}
    for line in lines:  # the first processor's entries
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return f"{fields.get('model name', '')}|{fields.get('flags', fields.get('Features', ''))}"


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
        with exclusive_build(directory):
            if library.exists():  # another process built it while this one waited
                return _import(MODULE_NAME, library)
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


@contextmanager
def exclusive_build(directory: Path):
    """Hold the build of ``directory`` for this process alone. The lock is the kernel's (flock),
    so it goes with its process, however that ends; torch's own build lock is a plain file, which
    a build killed by a signal leaves behind, and every later build then waited on it forever
    with no message. While this lock is held no other build runs, so such a file is stale and is
    removed."""
    with open(directory / "specfork-build.lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning("another process is compiling the native CPU kernels in %s; waiting for it", directory)
            fcntl.flock(handle, fcntl.LOCK_EX)
        (directory / "lock").unlink(missing_ok=True)  # torch's, from a killed build
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


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
