"""What ``specfork bench`` runs: modes, datasets, peers and one validated settings object.
Importing it costs nothing (no torch), so ``specfork --help`` stays fast."""

from __future__ import annotations

from dataclasses import dataclass

from specfork.config import (
    DEFAULT_CORPUS_TOKENS,
    DEFAULT_DECODE_STEPS,
    DEFAULT_MODEL,
    MAX_THREADS,
    SSD_BACKUPS,
    SSD_DEFAULT_K,
    WEIGHTS,
)
from specfork.errors import SpecforkError
from specfork.options import comma_list, int_or_auto, on_off, option

MODES = ("ar", "sd", "ssd", "ngram")
DATASETS = ("humaneval", "sharegpt", "random")
PEERS = ("transformers", "llama.cpp")
SSD_DRAFTERS = ("process", "rank")
SWEEPABLE = {"k": int_or_auto, "draft_confidence": float, "lookup_first": int, "lookup_corpus": str, "corpus_tokens": int, "fan_out": int, "temperature": float, "top_p": float, "top_k": int, "input_len": int,
             "batch_size": int, "dataset": str, "tensor_parallel_size": int, "ssd_drafter": str, "weights": str,
             "cuda_graphs": on_off, "decode_steps": int}
# The settings that only some modes read: a value given for none of --modes would be ignored
# (a sweep of k over AR alone ran the same AR once per point).
MODE_OPTIONS = {"draft": ("sd", "ssd"), "k": ("sd", "ssd", "ngram"), "draft_confidence": ("sd",),
                "lookup_first": ("sd",), "lookup_corpus": ("sd", "ngram"), "corpus_tokens": ("sd", "ngram"),
                "fan_out": ("ssd",), "backup": ("ssd",), "ssd_drafter": ("ssd",), "target_cores": ("ssd",),
                "draft_cores": ("ssd",), "decode_steps": ("ar", "sd", "ngram")}
PEER_OPTIONS = {"draft": ("transformers",)}  # its assisted generation drafts with the same draft


def dataset_list(text: str) -> tuple[str, ...]:
    """--datasets: a comma list, or all."""
    return DATASETS if text == "all" else comma_list(text)


@dataclass(frozen=True, slots=True)
class BenchSettings:
    model: str = option(DEFAULT_MODEL, "target model")
    draft: str = option("default", "draft for sd/ssd (default: the shipped draft)")
    modes: tuple[str, ...] = option(MODES, f"comma list of {', '.join(MODES)}", parse=comma_list)
    datasets: tuple[str, ...] = option(("humaneval", "sharegpt"), f"comma list of {', '.join(DATASETS)}, or all; "
                                       "with several, an 'all' row gives the mean", parse=dataset_list)
    num_prompts: int = option(4, "prompts per dataset")
    input_len: int | None = option(None, "cut (keeping the end) or repeat prompts to this many tokens; required "
                                   "for random")
    output_len: int = option(256, "generated tokens per request")
    ignore_eos: bool = option(True, "every request generates exactly --output-len tokens, past its EOS, in every "
                              "engine (the same work everywhere); --no-ignore-eos stops each at its end of "
                              "generation, as real requests stop and as EAGLE's accepted lengths are published")
    temperature: float = option(0.0, "0 = greedy")
    top_p: float = option(1.0, "nucleus sampling mass in (0, 1] at temperature > 0 (1 = off)")
    top_k: int = option(0, "keep the k most likely tokens at temperature > 0 (0 = off)")
    k: int | str | None = option(None, "speculated tokens per round, or auto (sd and ngram modes: chosen from "
                                 "measured costs, 0 where speculation does not pay) (default: the engine's, auto "
                                 f"for sd and ngram, {SSD_DEFAULT_K} for ssd)", parse=int_or_auto)
    draft_confidence: float | None = option(None, "SD with an EAGLE-3 head: take a chain's next token only while "
                                            "the head's chain probability times its top probability there is at "
                                            "least this (0: always k; default: the engine's, 0.3 with the shipped "
                                            "draft)")
    lookup_first: int | None = option(None, "SD with a draft or head: prompt lookup of the context's last "
                                      "N..4 tokens (generate's --ngram-max) proposes where it finds them, the draft "
                                      "elsewhere (0: off; default: the engine's, 2 with the shipped draft)")
    lookup_corpus: str | None = option(None, "sd (with lookup first) and ngram: prompt lookup's corpus of the "
                                       "target's responses, a path or none (default: the engine's, the corpus "
                                       "shipped for the embedded model)")
    corpus_tokens: int = option(DEFAULT_CORPUS_TOKENS, "sd (with lookup first) and ngram: the most tokens a round "
                                "proposes from the lookup corpus")
    fan_out: int = option(3, "SSD fan-out per outcome")
    backup: str = option("jit", "SSD cache-miss backup", choices=SSD_BACKUPS)
    batch_size: int = option(1, "concurrent requests")
    tensor_parallel_size: int = option(1, "specfork runs: split the target over this many ranks (torch.distributed; "
                                       "each rank gets --threads threads, default the cores / N); the time spent "
                                       "in the ranks' sums is reported")
    ssd_drafter: str = option("process", "SSD's drafter: a local process, or a rank of the engine's "
                              "torch.distributed world (--drafter-rank)", choices=SSD_DRAFTERS)
    weights: str = option("native", "specfork runs: the engine's --weights (native-int8: int8 activations)",
                          choices=WEIGHTS)
    device: str = option("cpu", "specfork runs: the engine's device, cpu or cuda[:N] (peers run on the CPU)")
    cuda_graphs: bool = option(True, "specfork runs on CUDA: the engine's --cuda-graphs (decode, verify and drafting "
                               "steps replayed as CUDA graphs; --no-cuda-graphs: eager; sweep it as "
                               "cuda_graphs=off,on)")
    decode_steps: int = option(DEFAULT_DECODE_STEPS, "specfork AR runs and SD's (sd, ngram) at k auto: the engine's --decode-steps "
                               "(decode steps run back to back in one native call; 1: one a call)")
    threads: int | None = option(None, "torch threads for AR/SD and peers (default: torch's)")
    repeat: int = option(1, "timed runs; the median is reported (a point's modes and peers, SSD aside, are "
                         "timed interleaved, prompt group by prompt group)")
    warmup: int = option(1, "untimed warm-up runs (16 tokens of the first batch on the CPU; on CUDA whole runs, which capture the CUDA graphs the timed runs use)")
    peers: tuple[str, ...] = option((), f"comma list of {', '.join(PEERS)}", parse=comma_list)
    seed: int = option(0, "the random dataset's seed and every request's sampling seed")
    target_cores: str | None = option(None, "SSD: the target's CPU cores (default: half of them)")
    draft_cores: str | None = option(None, "SSD: the drafter's CPU cores (default: the other half)")
    bandwidth: bool = option(False, (
        "measure this machine's streaming read bandwidth before and after the runs (best of 5 sums over "
        "1 GiB) and give each specfork AR run at batch 1 the weight bandwidth it reaches (weight bytes per decode "
        "step x decode steps/s from the requests' TPOT) and its share of the read bandwidth"))

    def __post_init__(self) -> None:
        for name, allowed in (("modes", MODES), ("datasets", DATASETS), ("peers", PEERS)):
            bad = [x for x in getattr(self, name) if x not in allowed]
            if bad:
                raise SpecforkError(f"unknown {name} {bad}; choose from {', '.join(allowed)}")
        if not self.modes:
            raise SpecforkError("--modes needs at least one mode")
        if not self.datasets:
            raise SpecforkError(f"--datasets needs at least one of {', '.join(DATASETS)}")
        self._refuse_options_of_other_modes()
        if self.k == "auto":
            if "ssd" in self.modes:
                raise SpecforkError("k auto is for the sd and ngram modes (SSD's k also shapes the drafter's tree): "
                                    "pass a number, or leave ssd out of --modes")
        elif self.k is not None and (not isinstance(self.k, int) or isinstance(self.k, bool)):
            raise SpecforkError(f"k must be an integer >= 1 or auto, got {self.k!r}")
        if self.weights not in WEIGHTS:
            raise SpecforkError(f"weights must be one of {', '.join(WEIGHTS)}, got {self.weights!r}")
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise SpecforkError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.ssd_drafter not in SSD_DRAFTERS:
            raise SpecforkError(f"ssd_drafter must be one of {', '.join(SSD_DRAFTERS)}, got {self.ssd_drafter!r}")
        for name in ("num_prompts", "output_len", "fan_out", "batch_size", "repeat", "tensor_parallel_size", "decode_steps") + (("k",) if isinstance(self.k, int) else ()):
            if getattr(self, name) < 1:
                raise SpecforkError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lookup_first is not None and (isinstance(self.lookup_first, bool)
                                              or not isinstance(self.lookup_first, int) or self.lookup_first < 0):
            raise SpecforkError(f"lookup_first must be an integer >= 0 (0: off), got {self.lookup_first!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise SpecforkError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise SpecforkError(f"top_k must be an integer >= 0 (0: off), got {self.top_k!r}")
        if self.warmup < 0:
            raise SpecforkError(f"warmup must be >= 0, got {self.warmup}")
        if self.batch_size > self.num_prompts:
            raise SpecforkError(f"batch_size {self.batch_size} needs at least that many prompts to run together; "
                                f"--num-prompts is {self.num_prompts} (give --num-prompts {self.batch_size} or more)")
        if self.threads is not None and not 1 <= self.threads <= MAX_THREADS:
            raise SpecforkError(f"threads must be in 1..{MAX_THREADS}, got {self.threads}")
        if self.input_len is not None and self.input_len < 1:
            raise SpecforkError(f"input_len must be >= 1, got {self.input_len}")
        if "random" in self.datasets and self.input_len is None:
            raise SpecforkError("the random dataset needs --input-len" + (" (--datasets all includes it)"
                                                                          if set(self.datasets) == set(DATASETS) else ""))

    def _refuse_options_of_other_modes(self) -> None:
        defaults = BenchSettings.__dataclass_fields__
        for name in MODE_OPTIONS:
            if getattr(self, name) != defaults[name].default:
                self.check_read(name, f"{name} {getattr(self, name)!r}")
        if self.decode_steps != DEFAULT_DECODE_STEPS and "ar" not in self.modes and isinstance(self.k, int):
            raise SpecforkError(f"decode_steps {self.decode_steps}: SD's runs read it only at k auto (the rounds where "
                                f"it decodes plainly) and k is {self.k}: add ar to --modes, or leave decode_steps out")

    def check_read(self, name: str, what: str) -> None:
        """``what`` (an option's value, or a sweep axis) is refused where none of --modes (and no
        peer) reads ``name``."""
        modes, peers = MODE_OPTIONS.get(name, ()), PEER_OPTIONS.get(name, ())
        if not modes or set(modes) & set(self.modes) or set(peers) & set(self.peers):
            return
        readers = f"the {', '.join(modes)} mode{'s' if len(modes) > 1 else ''}" + (
            f" and the {', '.join(peers)} peer" if peers else "")
        raise SpecforkError(f"{what}: only {readers} read{'' if len(modes) > 1 or peers else 's'} {name}, and --modes "
                            f"runs {', '.join(self.modes)}: add {'one of them' if len(modes) > 1 else modes[0]} to "
                            f"--modes, or leave {name} out")
