"""What ``specfork bench`` runs: modes, datasets, peers and one validated settings object.
Importing it costs nothing (no torch), so ``specfork --help`` stays fast."""

from __future__ import annotations

from dataclasses import dataclass, field

from specfork.errors import SpecforkError

MODES = ("ar", "sd", "ssd", "ngram")
DATASETS = ("humaneval", "sharegpt", "random")
PEERS = ("transformers", "llama.cpp")
SWEEPABLE = {"k": lambda text: text if text == "auto" else int(text), "fan_out": int, "temperature": float, "input_len": int, "batch_size": int, "dataset": str}


@dataclass(frozen=True, slots=True)
class BenchSettings:
    model: str = "smollm2-135m"
    draft: str = "default"
    modes: tuple[str, ...] = ("ar", "sd", "ssd", "ngram")
    datasets: tuple[str, ...] = ("humaneval", "sharegpt")
    num_prompts: int = 4
    input_len: int | None = None
    output_len: int = 256
    temperature: float = 0.0
    k: int | str = 5  # or "auto" (SD and n-gram modes)
    fan_out: int = 3
    backup: str = "jit"
    batch_size: int = 1
    threads: int | None = None
    repeat: int = 1
    warmup: int = 1
    peers: tuple[str, ...] = ()
    seed: int = 0
    target_cores: str | None = None  # SSD core placement (default: halves)
    draft_cores: str | None = None
    bandwidth: bool = field(default=False, metadata={"help": (
        "measure this machine's streaming read bandwidth before and after the runs (best of 5 sums over "
        "1 GiB) and give each specfork AR run the weight bandwidth it reaches (weight bytes per decode "
        "step x decode steps/s from the requests' TPOT) and its share of the read bandwidth")})

    def __post_init__(self) -> None:
        for name, allowed in (("modes", MODES), ("datasets", DATASETS), ("peers", PEERS)):
            bad = [x for x in getattr(self, name) if x not in allowed]
            if bad:
                raise SpecforkError(f"unknown {name} {bad}; choose from {', '.join(allowed)}")
        if not self.modes:
            raise SpecforkError("--modes needs at least one mode")
        if self.k == "auto":
            if "ssd" in self.modes:
                raise SpecforkError("k auto is for the sd and ngram modes (SSD's k also shapes the drafter's tree): "
                                    "pass a number, or leave ssd out of --modes")
        elif not isinstance(self.k, int) or isinstance(self.k, bool):
            raise SpecforkError(f"k must be an integer >= 1 or auto, got {self.k!r}")
        for name in ("num_prompts", "output_len", "fan_out", "batch_size", "repeat") + (("k",) if self.k != "auto" else ()):
            if getattr(self, name) < 1:
                raise SpecforkError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise SpecforkError(f"warmup must be >= 0, got {self.warmup}")
        if self.input_len is not None and self.input_len < 1:
            raise SpecforkError(f"input_len must be >= 1, got {self.input_len}")
        if "random" in self.datasets and self.input_len is None:
            raise SpecforkError("the random dataset needs --input-len")
