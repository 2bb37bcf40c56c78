"""The machine a benchmark runs on and how much of it a run uses: identity (CPU, cores, torch,
commit), streaming memory bandwidth, and the weight bytes one forward of a model reads."""

from __future__ import annotations

import os
import platform
import subprocess

import torch

from specfork.bench.timing import timed


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    commit = _source_commit()
    from specfork.native_kernels import instruction_set

    return {
        "cpu": cpu,
        "kernels": instruction_set(),
        "cores": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "commit": commit or None,
    }


def _source_commit() -> str:
    """The commit of the checkout this specfork runs from, "+modified" when its tracked files
    differ from it; "" where there is none (an installed package, no git)."""
    source = os.path.dirname(os.path.abspath(__file__))

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=source).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        if commit and git("status", "--porcelain", "--untracked-files=no"):
            commit += "+modified"
    except OSError:  # no git on this machine
        return ""
    return commit


def native_kernels_or_exit():
    """The native kernel module, for scripts that time it; exits with a plain message where it
    cannot be built (no compiler)."""
    from specfork.native_kernels import kernels

    k = kernels()
    if k is None:
        raise SystemExit("the native kernels are not available on this machine")
    return k


def read_bandwidth(nbytes: int = 2**30, repeats: int = 5) -> dict:
    """Best-of-``repeats`` GB/s with torch's current thread count over an fp32 tensor of
    ``nbytes``: a read-only sum, and a copy (counted as bytes read + bytes written). A shared VM
    varies by up to 2x from one minute to the next, so measure close to what it is compared with."""
    n = nbytes // 4
    src = torch.ones(n)
    dst = torch.empty(n)
    dst.copy_(src)  # fault in the pages
    read = min(timed(src.sum)[1] for _ in range(repeats))
    copy = min(timed(dst.copy_, src)[1] for _ in range(repeats))
    return {"read_GBps": n * 4 / read / 1e9, "copy_GBps": 2 * n * 4 / copy / 1e9}


def weight_bytes(model) -> dict:
    """Weight bytes one forward reads for one sequence, and KV-cache bytes per context token.

    Linear layers count once at their logical size (a DenseLinear keeps more than one layout of
    its weight but reads one per call; a QuantizedLinear its packed blocks), biases and norms
    included; a tied LM head is a linear layer and counts once; the embedding lookup reads one
    row per token and is left out."""
    from specfork.layers.linear import DenseLinear
    from specfork.layers.norm import RMSNorm
    from specfork.layers.quantized import QuantizedLinear

    def nbytes(t) -> int:
        return 0 if t is None else t.numel() * t.element_size()

    linear = norms = 0
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            linear += m.weight_bytes + nbytes(m.bias)
        elif isinstance(m, DenseLinear):
            linear += nbytes(m.weight) + nbytes(m.bias)
        elif isinstance(m, RMSNorm):
            norms += sum(nbytes(p) for p in m.parameters())
    cfg = model.config
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * model.embed_tokens.weight.element_size()
    return {"weights": linear + norms, "linear": linear, "norms": norms, "kv_per_context_token": kv}


def decode_steps_per_s(metrics: list[dict]) -> float | None:
    """Decode steps per second from requests' ``num_generated_tokens`` and ``tpot_s`` (prefill
    excluded), pooled: sum(n - 1) / sum((n - 1) * tpot). Requests decoding side by side share
    each step, so this is the step rate at any batch size; at batch 1 it is decode tokens/s."""
    timed_rows = [(m["num_generated_tokens"] - 1, m["tpot_s"]) for m in metrics if m.get("tpot_s")]
    seconds = sum(n * tpot for n, tpot in timed_rows)
    return sum(n for n, _ in timed_rows) / seconds if seconds > 0 else None
