"""The engine configuration: one frozen dataclass, validated once."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from pathlib import Path

from specfork.errors import SpecforkError
from specfork.fanout import parse_fanout, uniform_fanout
from specfork.options import flag_of, int_or_auto, only_for, option, seconds_or_auto

DEFAULT_MODEL = "smollm2-135m"
DTYPES = ("float32", "bfloat16", "float16")
# SD's defaults with the shipped draft, measured best on the embedded model (docs/benchmarks.md): the
# head's confidence floor and the n-gram length looked up before drafting.
DEFAULT_DRAFT_CONFIDENCE = 0.3
DEFAULT_LOOKUP_FIRST = 2
DEFAULT_CORPUS_TOKENS = 2
KV_DTYPES = ("float32", "float16")
DIST_LAUNCHES = ("local", "torchrun")
MODES = ("ar", "sd", "ssd")
SSD_BACKUPS = ("jit", "fast")
TREE_BACKENDS = ("sdpa", "fast")
DRAFTERS = ("draft", "ngram")
WEIGHTS = ("native", "native-int8", "fp32")
QUANTIZE = ("int4",)
QUANTIZE_GROUPS = (32, 64, 128)
DEFAULT_QUANTIZE_GROUP = 32
K_MAX = 8  # the most tokens k "auto" may propose in a round
SSD_DEFAULT_K = 5  # SSD's k when none is given (SD's is "auto")
DEFAULT_DECODE_STEPS = 4  # plain decoding's decode steps per native call (docs/decisions.md)
MAX_DECODE_STEPS = 32
SD_ONLY = ("draft_confidence", "ngram_min", "ngram_max", "lookup_first")  # speculative options SSD does not read
MAX_THREADS = 1024  # --threads beyond this crashes OpenMP (thread creation fails, or a segfault)


ENGINE, SPECULATIVE, SSD = "engine", "speculative decoding", "SSD (--mode ssd)"


@dataclass(frozen=True, slots=True)
class Config:
    """Everything that decides how an engine is built. Each field's help text says what it does;
    the command line (``specfork generate|serve --help``) is generated from these fields."""

    model: str = option(DEFAULT_MODEL, f"model alias, HF model directory or .gguf file (default: {DEFAULT_MODEL}, "
                        "the embedded SmolLM2-135M-Instruct Q4_1 GGUF)", group=ENGINE)
    device: str = option("cpu", "cpu or cuda[:N]", group=ENGINE)
    dtype: str | None = option(None, "weight/activation dtype (default: float32; bfloat16/float16 on CUDA only)",
                               choices=DTYPES, group=ENGINE)
    block_size: int = option(16, "tokens per KV-cache block", group=ENGINE)
    num_kv_blocks: int | None = option(None, "KV-cache blocks of --block-size tokens (default: enough for "
                                       "--kv-cache-tokens)", group=ENGINE)
    kv_cache_tokens: int = option(16384, "KV-cache capacity in tokens over all sequences", group=ENGINE)
    kv_cache_dtype: str | None = option(None, "KV-cache element type: float16 halves the cache's memory and what "
                                        "attention reads (keys and values rounded to fp16; tolerance in "
                                        "docs/benchmarks.md) (default: float16 for a model whose projections run "
                                        "the native quantised kernels on the CPU, else the model's dtype)",
                                        choices=KV_DTYPES, group=ENGINE)
    max_num_seqs: int = option(32, "most sequences decoded together", group=ENGINE)
    prefix_caching: bool = option(True, "reuse the KV-cache blocks of a prompt's leading tokens that an earlier "
                                  "request computed (a shared system prompt, a conversation's earlier turns) "
                                  "instead of computing them again (SD's EAGLE-3 head keeps its own rows of them "
                                  "cached alike; not SSD with a head, nor requests asking for the prompt's "
                                  "log-probabilities); --no-prefix-caching computes every prompt in full",
                                  group=ENGINE)
    cuda_graphs: bool = option(True, "on CUDA, replay decode, verify and drafting steps as CUDA graphs captured on "
                               "first use (a small model's eager step is bound by kernel launches); "
                               "--no-cuda-graphs runs every step eagerly", group=ENGINE)
    decode_steps: int = option(DEFAULT_DECODE_STEPS, "plain decoding (--mode ar, and SD's rounds where --k auto "
                               "chose not to speculate) on the CPU's one-call native path: a decode step takes up "
                               "to this many tokens for each request without a grammar, allowed ids or bad words, "
                               "greedy or sampled (penalties, logit bias, min_p, min_tokens and log-probabilities go "
                               "along); their forwards run back to back in one native call with each token chosen "
                               "and fed back there (the same tokens as one step at a time, a seeded request's too, "
                               "without Python between them); 1: one token a step",
                               group=ENGINE)
    max_num_batched_tokens: int = option(4096, "most tokens in one forward pass; longer prompts are prefilled "
                                         "in chunks", group=ENGINE)
    max_model_len: int | None = option(None, "longest prompt + output (default: the model's context length, "
                                       "capped by the KV cache)", group=ENGINE)
    threads: int | None = option(None, "CPU threads for torch, per tensor-parallel rank (default: torch's choice; "
                                 "with --tensor-parallel-size N, the available cores / N)", group=ENGINE)
    tensor_parallel_size: int = option(1, "split the model over N ranks (torch.distributed: gloo on CPU, NCCL on "
                                       "CUDA): attention heads, the KV cache and the MLP split, one all-reduce "
                                       "after each; rank 0 schedules and samples, the others run their shards "
                                       "(see --distributed-launch)", group=ENGINE)
    distributed_launch: str = option("local", "local: the engine starts ranks 1..N-1 on this host; torchrun: this "
                                     "process is one rank of a group torchrun started (several hosts: torchrun "
                                     "--nnodes ... -m specfork generate ... on each); rank 0 runs the command, the "
                                     "others serve forwards and exit when it is done",
                                     choices=DIST_LAUNCHES, group=ENGINE)
    dist_timeout_s: float = option(120.0, "seconds a rank at work (a forward, a message) may go without "
                                   "answering before the run ends with an error; ranks wait as long as the "
                                   "engine is idle, and start-up may take at least 120 s",
                                   flag="--dist-timeout", group=ENGINE)
    seed: int = option(0, "the engine's seed, the same in every command: each request samples with a generator "
                       "derived from it and the request's position, so a run is reproducible", group=ENGINE)
    mode: str = option("ar", "ar: autoregressive; sd: speculative decoding (a drafter proposes --k tokens, the "
                       "model verifies them in one pass; output distribution unchanged); ssd: speculative "
                       "speculative decoding (the draft runs in its own process on its own cores or GPU and "
                       "pre-drafts the next round for likely verification outcomes)", choices=MODES, group=SPECULATIVE)
    drafter: str = option("draft", "SD proposer: a draft model (--draft) or n-gram prompt lookup "
                          "(--ngram-min..--ngram-max tokens)", choices=DRAFTERS, group=SPECULATIVE)
    draft: str | None = option(None, "draft for --drafter draft: an HF directory or .gguf file sharing the "
                               "target's vocabulary, an EAGLE-3 head directory (it reads the target's own "
                               "features), or 'default' (also used when omitted): the draft shipped with specfork "
                               "for the embedded model (in any file of it: same architecture, tokens and chat template)", group=SPECULATIVE)
    k: int | str | None = option(None, "tokens proposed per round, or auto (SD): chosen for each batch size from "
                                 "the draft and target step times measured at start-up and the acceptance observed "
                                 "while generating, 0 (plain decoding) where speculation does not pay "
                                 "(speculative/auto_k.py); the choice and its reasons are reported. Sampling with a "
                                 "seed is reproducible in SD at a fixed k; auto's choice follows measured times, so it "
                                 "may not be, and SSD's hits and misses follow timing, so it is not (default: auto "
                                 f"for SD, {SSD_DEFAULT_K} for SSD)",
                                 parse=int_or_auto, group=SPECULATIVE)
    draft_confidence: float | None = option(
        None, "SD with an EAGLE-3 head: take a chain's next token only while the head's probability of the chain "
        "so far times its top probability there is at least this, so a chain may be empty (0: always draft --k "
        "tokens; SSD's branches always have --k) (default: 0.3 with the shipped draft, measured best with "
        "--lookup-first 2 on the embedded model; 0 with any other draft)", group=SPECULATIVE)
    ngram_min: int = option(1, "shortest n-gram matched by --drafter ngram", group=SPECULATIVE)
    ngram_max: int = option(4, "longest n-gram matched by SD's prompt lookup (--drafter ngram, or --lookup-first)",
                            group=SPECULATIVE)
    lookup_first: int | None = option(
        None, "SD with a draft model or EAGLE-3 head: where the context's last N tokens (up to --ngram-max) "
        "occurred earlier, propose what followed them (prompt lookup) instead of drafting; the draft proposes "
        "elsewhere (0: off) (default: 2 with the shipped draft, measured best on the embedded model; 0 with "
        "any other draft)", group=SPECULATIVE)
    lookup_corpus: str | None = option(
        None, "SD's prompt lookup (--drafter ngram, or --lookup-first before a draft): where the prompt and output "
        "hold no match, look the context's last 8, 6, 4 or 3 tokens up in this corpus of the target's responses "
        "(the lookup_corpus.npz that train-draft writes in its --work-dir) and propose what followed there; 'none': "
        "off (default: the corpus shipped for the target, if any: the embedded model has one)", group=SPECULATIVE)
    corpus_tokens: int = option(
        DEFAULT_CORPUS_TOKENS, "the most tokens a round proposes from the lookup corpus (at most --k; prompt lookup's "
        "matches in the context itself still propose --k): a corpus match is accepted far less often (0.13-0.14 of "
        "5 proposed tokens on the embedded model), so its later tokens mostly cost verify rows (default: 2, "
        "measured on the embedded model)", group=SPECULATIVE)
    deterministic: bool = option(False, "batch-invariant kernels: greedy SD/SSD output is bit-identical to AR "
                                 "output (the default fast mode may differ at numerical near-ties; slower)",
                                 group=SPECULATIVE)
    fan_out: int = option(3, "branches pre-drafted per verification outcome, uniform", group=SSD)
    fan_out_list: str | list[int] | None = option(
        None, "per-outcome fan-out for rounds that hit the cache: k+1 counts like 3,2,2,1,1,1, or geometric:TOTAL "
        "for the paper's capped-geometric allocation (overrides --fan-out)", parse=str, group=SSD)
    fan_out_list_miss: str | list[int] | None = option(
        None, "fan-out after a round that missed the cache, same forms and total (default: the hit list)",
        parse=str, group=SSD)
    backup: str = option("jit", "on a cache miss: jit drafts now; fast guesses by n-gram lookup with no draft "
                         "compute", choices=SSD_BACKUPS, group=SSD)
    saguaro_x: float | None = option(None, "Saguaro sampling coefficient C in (0, 1] for temperature > 0 "
                                     "(default: off)", group=SSD)
    tree_backend: str = option("fast", "tree-decode attention: fast (per-branch block tables, the native paged "
                               "kernel) or sdpa (reference, explicit tree mask)", choices=TREE_BACKENDS, group=SSD)
    drafter_device: str | None = option(None, "the drafter's device (default: the next GPU, wrapping around, when "
                                        "the target is on CUDA and another GPU exists, else the target's device)",
                                        group=SSD)
    drafter_rank: int | None = option(None, "run the drafter as this rank of the torch.distributed world instead "
                                      "of a local process: rank --tensor-parallel-size (the one after the "
                                      "model's ranks), started here (--distributed-launch local) or by torchrun on "
                                      "any host, on --drafter-device there. A rank that fails is not restarted: "
                                      "drafting goes on in-process (default: a local process)", group=SSD)
    target_cores: str | None = option(None, "CPU cores of the target, e.g. 0 or 0-3 (default: the first half of "
                                      "the available cores)", group=SSD)
    draft_cores: str | None = option(None, "CPU cores of the drafter process (default: the other half)", group=SSD)
    drafter_timeout_s: float | None = option(
        None, "seconds to wait for the drafter before declaring it failed (requests go on in-process while it "
        "restarts), or auto: 10x the expected answer from the observed round times, 2 to 60 s "
        "(speculative/ssd/deadline.py) (default: auto)", parse=seconds_or_auto, flag="--drafter-timeout", group=SSD)
    weights: str = option("native", "native: run a GGUF's Q4_0/Q4_1/Q8_0/Q5_0/Q5_1/Q2_K-Q6_K/IQ4_NL/IQ4_XS matrices quantised (native CPU kernel, "
                          "no per-step dequantisation, activations rounded to int16 per quantisation group of 16-32; an EAGLE-3 "
                          "head's projections run the int4 kernel); native-int8: the same with activations rounded "
                          "to int8 as llama.cpp does (about a third fewer multiply-add instructions for "
                          "verification windows and batches, with VNNI; logits move about 3e-2 of the largest "
                          "logit, tested at 8e-2: docs/decisions.md); fp32: dequantise at load, heads stay float. "
                          "Target and draft alike",
                          choices=WEIGHTS, group=ENGINE)
    quantize: str | None = option(None, "quantise an HF checkpoint's projections to 4 bits at load, for the same "
                                  "kernel (default: off, float32)", choices=QUANTIZE, group=ENGINE)
    quantize_group: int = option(DEFAULT_QUANTIZE_GROUP, "inputs per scale for --quantize", choices=QUANTIZE_GROUPS,
                                 group=ENGINE)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise SpecforkError("model must be a non-empty string (an alias, an HF directory or a .gguf file)")
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise SpecforkError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise SpecforkError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.device == "cpu" and self.dtype not in (None, "float32"):
            raise SpecforkError(f"dtype {self.dtype} is not supported on CPU; use float32")
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_DTYPES:
            raise SpecforkError(f"kv_cache_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_cache_dtype!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise SpecforkError(f"seed must be an integer, got {self.seed!r}")
        _positive("block_size", self.block_size)
        _positive("kv_cache_tokens", self.kv_cache_tokens)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("decode_steps", self.decode_steps)
        if self.decode_steps > MAX_DECODE_STEPS:
            raise SpecforkError(f"decode_steps must be at most {MAX_DECODE_STEPS} (each decode step reserves KV slots "
                                f"for them all, and they save little past a few), got {self.decode_steps}")
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.num_kv_blocks is not None:
            _positive("num_kv_blocks", self.num_kv_blocks)
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if self.threads is not None:
            _positive("threads", self.threads)
            if self.threads > MAX_THREADS:
                raise SpecforkError(f"threads must be at most {MAX_THREADS}, got {self.threads} (one per core is "
                                    "what decoding wants)")
        if self.mode not in MODES:
            raise SpecforkError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        stray = self._options_of_other_modes()
        if self.drafter not in DRAFTERS:
            raise SpecforkError(f"drafter must be one of {', '.join(DRAFTERS)}, got {self.drafter!r}")
        if self.k is None:  # SD: auto, which falls back to plain decoding where drafts do not pay
            object.__setattr__(self, "k", "auto" if self.mode == "sd" else SSD_DEFAULT_K)
        if self.k == "auto":
            if self.mode == "ssd":
                raise SpecforkError("k 'auto' is for SD; SSD's k also shapes the drafter's tree: set it, "
                                    "e.g. from `specfork bench --sweep k=2,3,5`")
        else:
            _positive("k", self.k)
        if self.k_max > 32:
            raise SpecforkError(f"k must be at most 32, got {self.k}")
        if self.draft_confidence is not None and (
                isinstance(self.draft_confidence, bool) or not isinstance(self.draft_confidence, (int, float))
                or not 0.0 <= self.draft_confidence < 1.0):
            raise SpecforkError(f"draft_confidence must be in [0, 1), got {self.draft_confidence!r}")
        _positive("ngram_min", self.ngram_min)
        _positive("ngram_max", self.ngram_max)
        if self.ngram_min > self.ngram_max:
            raise SpecforkError(f"ngram_min ({self.ngram_min}) must not exceed ngram_max ({self.ngram_max})")
        self._check_lookup_first()
        self._check_lookup_corpus()
        _positive("corpus_tokens", self.corpus_tokens)
        if self.draft is not None and (not isinstance(self.draft, str) or not self.draft):
            raise SpecforkError("draft must be a non-empty path or alias")
        if not isinstance(self.deterministic, bool):
            raise SpecforkError(f"deterministic must be True or False, got {self.deterministic!r}")
        if not isinstance(self.cuda_graphs, bool):
            raise SpecforkError(f"cuda_graphs must be True or False, got {self.cuda_graphs!r}")
        if self.backup not in SSD_BACKUPS:
            raise SpecforkError(f"backup must be one of {', '.join(SSD_BACKUPS)}, got {self.backup!r}")
        _positive("fan_out", self.fan_out)
        if self.tree_backend not in TREE_BACKENDS:
            raise SpecforkError(f"tree_backend must be one of {', '.join(TREE_BACKENDS)}, got {self.tree_backend!r}")
        hit, miss = self.fan_out_lists
        if sum(miss) != sum(hit):
            raise SpecforkError(f"fan_out_list_miss {list(miss)} must have the same total as the hit list {list(hit)}")
        if self.saguaro_x is not None and (
            not isinstance(self.saguaro_x, (int, float)) or isinstance(self.saguaro_x, bool)
            or not 0.0 < self.saguaro_x <= 1.0
        ):
            raise SpecforkError(f"saguaro_x (the Saguaro sampling coefficient C) must be in (0, 1], got {self.saguaro_x!r}")
        if self.drafter_device is not None and self.drafter_device.split(":")[0] not in ("cpu", "cuda"):
            raise SpecforkError(f"drafter_device must be 'cpu' or 'cuda[:N]', got {self.drafter_device!r}")
        self._check_distributed()
        cores = {name: parse_cores(getattr(self, name), name) for name in ("target_cores", "draft_cores")
                 if getattr(self, name) is not None}
        if len(cores) == 2 and set(cores["target_cores"]) & set(cores["draft_cores"]):
            raise SpecforkError(f"target_cores ({self.target_cores}) and draft_cores ({self.draft_cores}) overlap: "
                                "SSD's drafter runs beside the target, on cores of its own")
        if self.drafter_timeout_s is not None and (
            not isinstance(self.drafter_timeout_s, (int, float)) or isinstance(self.drafter_timeout_s, bool)
            or not self.drafter_timeout_s > 0
        ):
            raise SpecforkError(f"drafter timeout (--drafter-timeout) must be a number of seconds > 0 or auto, got "
                                f"{self.drafter_timeout_s!r}")
        if self.weights not in WEIGHTS:
            raise SpecforkError(f"weights must be one of {', '.join(WEIGHTS)}, got {self.weights!r}")
        if self.quantize is not None and self.quantize not in QUANTIZE:
            raise SpecforkError(f"quantize must be one of {', '.join(QUANTIZE)} or None, got {self.quantize!r}")
        if self.quantize_group not in QUANTIZE_GROUPS:
            raise SpecforkError(f"quantize_group must be one of {QUANTIZE_GROUPS}, got {self.quantize_group!r}")
        # Last, so that the specific checks above speak first where they apply; from the options as
        # given, before defaults were filled in.
        self._refuse_options_of_other_modes(stray)
        self._refuse_options_of_other_sources()

    def _refuse_options_of_other_sources(self) -> None:
        """Options of a proposer or loader this run does not use, refused rather than ignored."""
        if self.mode == "sd" and self.drafter == "ngram":
            for f in fields(self):
                if f.name in ("draft", "draft_confidence") and getattr(self, f.name) is not None:
                    raise SpecforkError(f"{flag_of(f)} is for a draft model or EAGLE-3 head (--drafter draft); "
                                        "--drafter ngram proposes by prompt lookup and loads no draft")
        if self.corpus_tokens != DEFAULT_CORPUS_TOKENS and (not self.prompt_lookup or self.lookup_corpus == "none"):
            raise SpecforkError("--corpus-tokens caps the proposals of the lookup corpus, which only SD's prompt "
                                "lookup searches (--mode sd with --drafter ngram or --lookup-first N, and a "
                                "--lookup-corpus); this run searches none")
        if self.mode == "ssd" and self.draft_confidence is not None:
            raise SpecforkError("--draft-confidence is SD's floor on an EAGLE-3 head's chains; SSD's drafter "
                                "pre-drafts branches of --k tokens, whatever the confidence: leave it out, or use "
                                "--mode sd")
        lookup_alone = self.mode == "sd" and self.drafter == "ngram"
        if self.ngram_min != 1 and not lookup_alone:
            raise SpecforkError("--ngram-min is the shortest n-gram that --drafter ngram matches (--mode sd); "
                                + ("SD's lookup before a draft matches --lookup-first N tokens and up"
                                   if self.mode == "sd" else "SSD's fast backup looks n-grams up with fixed bounds (1..4)"))
        if self.ngram_max != 4 and not self.prompt_lookup:
            raise SpecforkError("--ngram-max is the longest n-gram that SD's prompt lookup matches (--mode sd with "
                                "--drafter ngram or --lookup-first N); " + (
                                    "this run (--mode sd, no lookup first) looks none up" if self.mode == "sd"
                                    else "SSD's fast backup looks n-grams up with fixed bounds (1..4)"))
        if self.decode_steps != DEFAULT_DECODE_STEPS and not (self.mode == "ar" or (self.mode == "sd" and self.auto_k)):
            raise SpecforkError("--decode-steps sets how many decode steps plain decoding (--mode ar, or SD's rounds "
                                "where --k auto chose not to speculate) runs in one native call; "
                                + ("SSD's rounds always verify drafts" if self.mode == "ssd" else
                                   "with a fixed --k every round verifies drafts") + ": leave it out")
        if self.quantize is None and self.quantize_group != DEFAULT_QUANTIZE_GROUP:
            raise SpecforkError("--quantize-group is the group size of --quantize; give --quantize int4 too")

    def _options_of_other_modes(self) -> list:
        """The speculative options given (not at their defaults) that this mode would ignore. (k is
        not one in AR: it sizes the verify windows an engine captures CUDA graphs for, in any mode;
        benchmarks/bench_cuda_graphs.py times AR engines' windows that way.)"""
        applies = {"ar": (), "sd": (SPECULATIVE,), "ssd": (SPECULATIVE, SSD)}[self.mode]
        return [f for f in fields(self) if f.metadata.get("group") in (SPECULATIVE, SSD)
                and f.metadata.get("group") not in applies and f.name not in ("mode", "deterministic", "k")
                and f.default is not MISSING and getattr(self, f.name) != f.default]

    def _refuse_options_of_other_modes(self, stray: list) -> None:
        """``--draft`` without ``--mode sd``, ``--fan-out`` with SD: refused, not silently ignored."""
        if stray:
            groups = {"--mode sd" if f.name in SD_ONLY else "--mode ssd" if f.metadata["group"] == SSD else "--mode sd or ssd"
                      for f in stray}
            where = groups.pop() if len(groups) == 1 else "--mode sd or ssd"
            raise SpecforkError(f"{only_for([flag_of(f) for f in stray], where)}; this run is --mode {self.mode}")

    def _check_lookup_first(self) -> None:
        n = self.lookup_first
        if n is None:
            return
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise SpecforkError(f"lookup_first must be an integer >= 0 (0: off), got {n!r}")
        if n == 0:
            return
        if self.mode == "sd" and self.drafter == "ngram":
            raise SpecforkError("lookup_first does nothing with --drafter ngram, which already is prompt lookup "
                                "alone; leave it out")
        if self.mode != "sd" or self.drafter != "draft":
            raise SpecforkError("lookup_first puts prompt lookup before a draft model or EAGLE-3 head in SD "
                                "(--mode sd --drafter draft); for lookup alone use --drafter ngram")
        if n > self.ngram_max:
            raise SpecforkError(f"lookup_first ({n}) must not exceed ngram_max ({self.ngram_max}), the longest "
                                "n-gram looked up")

    def _check_lookup_corpus(self) -> None:
        corpus = self.lookup_corpus
        if corpus is None or corpus == "none":
            return
        if not isinstance(corpus, str) or not corpus:
            raise SpecforkError(f"lookup_corpus must be a path, 'default' or 'none', got {corpus!r}")
        if not self.prompt_lookup:
            raise SpecforkError("lookup_corpus is searched by SD's prompt lookup: use --mode sd with --drafter ngram, "
                                "or with a draft and --lookup-first N")

    def _check_distributed(self) -> None:
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        if self.distributed_launch not in DIST_LAUNCHES:
            raise SpecforkError(f"distributed_launch must be one of {', '.join(DIST_LAUNCHES)}, "
                                f"got {self.distributed_launch!r}")
        if isinstance(self.dist_timeout_s, bool) or not isinstance(self.dist_timeout_s, (int, float)) \
                or not self.dist_timeout_s > 0:
            raise SpecforkError(f"dist_timeout_s must be > 0, got {self.dist_timeout_s!r}")
        if self.tensor_parallel_size == 1 and self.drafter_rank is None:  # no torch.distributed world
            for name, default, flag in (("dist_timeout_s", 120.0, "--dist-timeout"),
                                        ("distributed_launch", "local", "--distributed-launch")):
                if getattr(self, name) != default:
                    raise SpecforkError(f"{flag} is for a torch.distributed world (--tensor-parallel-size > 1 "
                                        "or --drafter-rank); this run starts none")
        if self.drafter_rank is not None:
            if self.mode != "ssd":
                raise SpecforkError("drafter_rank places SSD's drafter; it needs mode 'ssd'")
            if self.drafter_rank != self.tensor_parallel_size or isinstance(self.drafter_rank, bool):
                raise SpecforkError(f"drafter_rank must be {self.tensor_parallel_size}, the rank after the model's "
                                    f"{self.tensor_parallel_size} (tensor_parallel_size); got {self.drafter_rank!r}")

    @property
    def load_options(self) -> dict:
        """How checkpoints are turned into weights (target and draft)."""
        return {"weights": self.weights, "quantize_group": self.quantize_group if self.quantize else None}

    @property
    def fan_out_lists(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(F for rounds that hit, F for rounds that missed), k + 1 entries each."""
        hit = self.fan_out_list
        hit = tuple(parse_fanout(hit, self.k_max) if hit is not None else uniform_fanout(self.k_max, self.fan_out))
        miss = self.fan_out_list_miss
        return hit, (tuple(parse_fanout(miss, self.k_max)) if miss is not None else hit)

    @property
    def shipped_draft(self) -> bool:
        """SD drafts with the draft shipped for the embedded model (no --draft, 'default', or that
        draft's name, e.g. smollm2-135m-eagle3: named, it gets the defaults measured for it too)."""
        from specfork.loading.resolve import DEFAULT_DRAFT, SHIPPED_DRAFTS

        preferred = {Path(names[0]).stem for names in SHIPPED_DRAFTS.values()}
        named = self.draft in (None, DEFAULT_DRAFT) or self.draft in preferred
        return self.mode == "sd" and self.drafter == "draft" and named

    @property
    def head_confidence(self) -> float:
        """The confidence floor of an EAGLE-3 head's chains in SD: draft_confidence, or its default
        (the measured one with the shipped draft, 0 with any other)."""
        if self.draft_confidence is not None:
            return float(self.draft_confidence)
        return DEFAULT_DRAFT_CONFIDENCE if self.shipped_draft else 0.0

    @property
    def lookup_first_n(self) -> int:
        """SD's prompt lookup before the draft: lookup_first, or its default (the measured one with
        the shipped draft, at most ngram_max; 0 with any other)."""
        if self.lookup_first is not None:
            return self.lookup_first
        return min(DEFAULT_LOOKUP_FIRST, self.ngram_max) if self.shipped_draft else 0

    @property
    def prompt_lookup(self) -> bool:
        """SD proposes by prompt lookup, alone (drafter ngram) or before a draft (lookup_first)."""
        return self.mode == "sd" and (self.drafter == "ngram" or self.lookup_first_n > 0)

    @property
    def auto_k(self) -> bool:
        return self.k == "auto"

    @property
    def k_max(self) -> int:
        """The most tokens a round may propose."""
        return K_MAX if self.auto_k else self.k

    @property
    def lookahead(self) -> int:
        """KV slots a decode step writes beyond the next token."""
        return 0 if self.mode == "ar" else self.k_max

    @property
    def torch_dtype_name(self) -> str:
        return self.dtype or "float32"


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SpecforkError(f"{name} must be an integer >= 1, got {value!r}")


def parse_cores(spec: str, name: str = "cores") -> tuple[int, ...]:
    """CPU core ids from "0", "0,2" or "0-3"."""
    cores: list[int] = []
    try:
        for part in spec.split(","):
            if "-" in part:
                lo, hi = part.split("-")
                cores.extend(range(int(lo), int(hi) + 1))
            else:
                cores.append(int(part))
    except ValueError:
        raise SpecforkError(f"{name} must look like 0 or 0,2 or 0-3, got {spec!r}") from None
    if not cores or any(c < 0 for c in cores):
        raise SpecforkError(f"{name} must name at least one core id >= 0, got {spec!r}")
    return tuple(dict.fromkeys(cores))
