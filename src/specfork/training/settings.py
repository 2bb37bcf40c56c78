"""Settings of ``specfork train-draft``: the data, the draft's architecture and the training run.
Importing it costs nothing (no torch), so ``specfork --help`` stays fast."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path

from specfork.config import DEFAULT_MODEL, MAX_THREADS
from specfork.errors import SpecforkError
from specfork.options import flag_of, int_or_auto, only_for, option
from specfork.output_paths import check_output_directory

DATA, ARCH, TRAIN, EVAL = 'data (target responses)', 'draft architecture', 'training', 'final evaluation'
EAGLE3 = 'EAGLE-3 head (--kind eagle3)'
DRAFT_VOCAB_SIZES = (4096, 8192, 16384)  # the sizes --draft-vocab auto chooses from
MAX_TTT_STEPS = 7


@dataclass(frozen=True, slots=True)
class DataSettings:
    num_prompts: int = option(1536, "training prompts", group=DATA)
    skip_prompts: int = option(0, "leave out the first N of them (an earlier run's prompts, e.g. the shipped "
                               "head's), so that a run resumed from that run's head (--init-head) answers and "
                               "trains on new prompts only", group=DATA)
    code_fraction: float = option(0.5, "share of code-block prompts", group=DATA)
    max_new_tokens: int = option(256, "response length cap", group=DATA)
    max_prompt_tokens: int = option(384, "prompts keep their last N tokens", group=DATA)
    shard_size: int = option(64, cli=False)  # examples per data shard (what a resumed run keeps)
    seed: int = option(0, cli=False)  # TrainSettings.seed: one --seed for data and training

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise SpecforkError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if not 0 <= self.skip_prompts < self.num_prompts:
            raise SpecforkError(f"skip_prompts must be in [0, num_prompts), got {self.skip_prompts} "
                                f"with num_prompts {self.num_prompts}")
        if not 0.0 <= self.code_fraction <= 1.0:
            raise SpecforkError(f"code_fraction must be in [0, 1], got {self.code_fraction}")
        if self.max_new_tokens < 1 or self.max_prompt_tokens < 1 or self.shard_size < 1:
            raise SpecforkError("max_new_tokens, max_prompt_tokens and shard_size must be >= 1")


@dataclass(frozen=True, slots=True)
class DraftArch:
    hidden_size: int = option(256, "the draft's hidden size", group=ARCH)
    num_layers: int = option(4, "decoder layers", flag="--layers", group=ARCH)
    intermediate_size: int = option(768, "MLP width", group=ARCH)
    num_heads: int = option(4, "attention heads", flag="--heads", group=ARCH)
    num_kv_heads: int = option(2, "key/value heads", flag="--kv-heads", group=ARCH)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "intermediate_size", "num_heads", "num_kv_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise SpecforkError(f"draft {name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise SpecforkError(f"hidden_size ({self.hidden_size}) must be a multiple of num_heads ({self.num_heads})")
        if self.num_heads % self.num_kv_heads:
            raise SpecforkError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if (self.hidden_size // self.num_heads) % 2:
            raise SpecforkError("hidden_size / num_heads (the head size) must be even for rotary embeddings")


@dataclass(frozen=True, slots=True)
class TrainSettings:
    epochs: float = option(4.0, "passes over the data", group=TRAIN)
    batch_tokens: int = option(4096, "padded tokens per optimizer step", group=TRAIN)
    max_seq_len: int = option(640, "longest training sequence in tokens", group=TRAIN)
    lr: float = option(2e-3, "peak learning rate, cosine decay", group=TRAIN)
    min_lr_ratio: float = option(0.1, "the learning rate's floor, as a share of --lr", group=TRAIN)
    warmup_steps: int = option(30, "linear learning-rate warm-up steps", group=TRAIN)
    weight_decay: float = option(0.01, "AdamW weight decay", group=TRAIN)
    grad_clip: float = option(1.0, "gradient-norm clip", group=TRAIN)
    checkpoint_every: int = option(50, "steps between checkpoints (an interrupted run resumes from the last)",
                                   group=TRAIN)
    seed: int = option(0, "data order, prompt selection and init", group=TRAIN)

    def __post_init__(self) -> None:
        if not 0 < self.epochs < math.inf:
            raise SpecforkError(f"--epochs must be a finite number > 0, got {self.epochs}")
        if self.batch_tokens < self.max_seq_len:
            raise SpecforkError(f"batch_tokens ({self.batch_tokens}) must be >= max_seq_len ({self.max_seq_len})")
        if self.max_seq_len < 16:
            raise SpecforkError(f"max_seq_len must be >= 16, got {self.max_seq_len}")
        if not 0 < self.lr < math.inf:
            raise SpecforkError(f"--lr must be a finite number > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise SpecforkError(f"--min-lr-ratio must be in [0, 1] (a share of --lr), got {self.min_lr_ratio}")
        if self.warmup_steps < 0:
            raise SpecforkError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.weight_decay < math.inf:
            raise SpecforkError(f"--weight-decay must be a finite number >= 0, got {self.weight_decay}")
        if not 0 < self.grad_clip < math.inf:
            raise SpecforkError(f"--grad-clip must be a finite number > 0 (the largest gradient norm), got "
                                f"{self.grad_clip}")
        if self.checkpoint_every < 1:
            raise SpecforkError(f"checkpoint_every must be >= 1, got {self.checkpoint_every}")


@dataclass(frozen=True, slots=True)
class Eagle3Settings:
    """What only an EAGLE-3 head needs (``--kind eagle3``); its shape is otherwise the target's."""

    ttt_steps: int = option(5, f"training-time-test unroll steps (1..{MAX_TTT_STEPS}); step j's loss weighs 0.8^j",
                            group=EAGLE3)
    draft_vocab: int | str = option(
        "auto", "the head's vocabulary: auto takes the smallest of "
        f"{'/'.join(map(str, DRAFT_VOCAB_SIZES))} covering 98% of the training responses' tokens, or a number",
        parse=int_or_auto, group=EAGLE3)
    head_intermediate_size: int | None = option(None, "the head's MLP width (default: the target's)", group=EAGLE3)
    feature_batch: int = option(8, "sequences per target pass when capturing features", group=EAGLE3)
    precision: str = option("auto", "the head's matrix products in bfloat16 (autocast over float32 weights) or "
                            "float32; auto: bf16 on CUDA and on CPUs with native bfloat16", choices=("auto", "bf16", "fp32"),
                            group=EAGLE3)
    init_head: Path | None = option(
        None, "start from this EAGLE-3 head's weights instead of new ones, keeping its MLP width, feature layers "
        "and (unless --reselect-draft-vocab) draft vocabulary, to go on training a head on more or other data",
        parse=Path, group=EAGLE3)
    draft_vocab_corpus: Path | None = option(
        None, "also count this lookup corpus's tokens when choosing the draft vocabulary (an earlier run's "
        "WORK_DIR/lookup_corpus.npz, or the shipped smollm2-135m-corpus.npz: the responses of the prompts that "
        "--skip-prompts leaves out)", parse=Path, group=EAGLE3)
    reselect_draft_vocab: bool = option(
        False, "with --init-head: choose that head's draft vocabulary anew (same size) from this run's counts; "
        "the LM-head rows of the ids it keeps stay as trained, new ids start from the target's rows mapped into "
        "the head's readout", group=EAGLE3)
    shard_size: int = option(64, cli=False)  # sequences per feature shard (what a resumed run keeps)

    def __post_init__(self) -> None:
        if not 1 <= self.ttt_steps <= MAX_TTT_STEPS:
            raise SpecforkError(f"ttt_steps must be in 1..{MAX_TTT_STEPS}, got {self.ttt_steps}")
        if self.draft_vocab != "auto" and (not isinstance(self.draft_vocab, int) or self.draft_vocab < 1):
            raise SpecforkError(f"draft_vocab must be auto or a positive integer, got {self.draft_vocab!r}")
        if self.head_intermediate_size is not None and self.head_intermediate_size < 1:
            raise SpecforkError(f"head_intermediate_size must be >= 1, got {self.head_intermediate_size}")
        if self.init_head is not None and (self.head_intermediate_size is not None or self.draft_vocab != "auto"):
            raise SpecforkError("--init-head keeps that head's MLP width and draft vocabulary; leave out "
                                "--head-intermediate-size and --draft-vocab")
        if self.reselect_draft_vocab and self.init_head is None:
            raise SpecforkError("--reselect-draft-vocab re-chooses the vocabulary of the --init-head head; give "
                                "--init-head too (a new head always chooses its vocabulary)")
        from specfork.loading.eagle3 import is_eagle3_checkpoint  # (torch: not at the CLI schema's import)

        if self.init_head is not None and not is_eagle3_checkpoint(Path(self.init_head)):
            raise SpecforkError(f"--init-head {self.init_head}: not an EAGLE-3 head directory (its config.json does "
                                "not name the EAGLE-3 draft architecture)")
        if self.draft_vocab_corpus is not None and not Path(self.draft_vocab_corpus).is_file():
            raise SpecforkError(f"--draft-vocab-corpus {self.draft_vocab_corpus}: no such file (a lookup corpus "
                                "written by train-draft, WORK_DIR/lookup_corpus.npz)")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise SpecforkError(f"precision must be auto, bf16 or fp32, got {self.precision!r}")
        if self.feature_batch < 1 or self.shard_size < 1:
            raise SpecforkError("feature_batch and shard_size must be >= 1")


@dataclass(frozen=True, slots=True)
class TrainDraftJob:
    """One ``specfork train-draft`` run: the target, where the draft goes and the settings."""

    target: str = option(DEFAULT_MODEL, "target model")
    kind: str = option("draft", "draft: a small Llama sharing the target's vocabulary; eagle3: an EAGLE-3 head "
                       "reading the target's hidden states", choices=("draft", "eagle3"))
    output: Path | None = option(None, "directory for the trained draft or head (HF format; required)", parse=Path)
    work_dir: Path | None = option(None, "data shards and checkpoints (default: OUTPUT.work)", parse=Path)
    data: DataSettings = field(default_factory=DataSettings, metadata={"cli": False})
    arch: DraftArch = field(default_factory=DraftArch, metadata={"cli": False})
    train: TrainSettings = field(default_factory=TrainSettings, metadata={"cli": False})
    eagle3: Eagle3Settings = field(default_factory=Eagle3Settings, metadata={"cli": False})
    device: str = option("cpu", "cpu or cuda[:N]")
    threads: int | None = option(None, "torch threads on CPU (default: torch's choice)")
    generation_batch: int = option(32, "concurrent generation requests", group=DATA)
    eval_prompts: int = option(4, "held-out HumanEval and ShareGPT prompts for the SD acceptance check; 0 skips it",
                               group=EVAL)
    eval_tokens: int = option(128, "tokens per evaluation prompt", group=EVAL)
    progress: bool = option(True, "progress bars")

    def __post_init__(self) -> None:
        if self.output is None:
            raise SpecforkError("train-draft needs an output directory (--output)")
        object.__setattr__(self, "output", Path(self.output))
        if self.output.name in ("", "..") or not self.output.resolve().name:  # ".", "/", "a/..", a link to /
            raise SpecforkError(f"--output {str(self.output)!r}: give the directory a name of its own (saving "
                                "replaces it as a whole)")
        if self.work_dir is None:
            object.__setattr__(self, "work_dir", self.output.with_name(self.output.name + ".work"))
        object.__setattr__(self, "work_dir", Path(self.work_dir))
        check_work_dir(self.work_dir, self.output)
        if self.generation_batch < 1 or self.eval_tokens < 1 or self.eval_prompts < 0:
            raise SpecforkError("--generation-batch and --eval-tokens must be >= 1, --eval-prompts >= 0")
        if self.threads is not None and not 1 <= self.threads <= MAX_THREADS:
            raise SpecforkError(f"--threads must be in 1..{MAX_THREADS}, got {self.threads}")
        check_replaceable_output(self.output)
        other, unused = (self.eagle3, Eagle3Settings()) if self.kind == "draft" else (self.arch, DraftArch())
        changed = [flag_of(f) for f in fields(other) if getattr(other, f.name) != getattr(unused, f.name)]
        if changed:
            needs = "--kind eagle3" if self.kind == "draft" else "--kind draft (an EAGLE-3 head takes the target's shape)"
            raise SpecforkError(only_for(changed, needs))


# The files a train-draft save writes (HF config, weights, tokenizer, provenance records).
RESULT_FILE_PATTERNS = ("*.json", "*.safetensors", "merges.txt", "*.model", "*.jinja")


def check_replaceable_output(output: Path) -> None:
    """Refuse, before any work, an output that saving would destroy or cannot create: a file, a
    directory that cannot be created, or one holding anything but an earlier train-draft result
    (saving replaces the directory, so a file of the user's in it would be lost)."""
    check_output_directory(output, "--output")
    if not output.is_dir() or not any(output.iterdir()):
        return
    if not (output / "specfork_draft.json").is_file():
        raise SpecforkError(f"--output {output} already holds files that are not a train-draft result; saving "
                            "replaces the whole directory, so give a new or empty one")
    foreign = sorted(p.name for p in output.iterdir()
                     if not p.is_file() or not any(p.match(pattern) for pattern in RESULT_FILE_PATTERNS))
    if foreign:
        raise SpecforkError(f"--output {output} is an earlier train-draft result but also holds {', '.join(foreign[:5])}"
                            f"{' ...' if len(foreign) > 5 else ''}, which saving would delete (it replaces the "
                            "whole directory); move them or give another --output")


def check_work_dir(work_dir: Path, output: Path) -> None:
    """The work dir must survive the save (which replaces ``output`` as a whole) and be creatable."""
    work, out = work_dir.resolve(), output.resolve()
    if work == out or out in work.parents:
        raise SpecforkError(f"--work-dir {work_dir} is inside --output {output}, which saving replaces as a whole "
                            "(the data and checkpoints would be deleted); give a directory outside it")
    check_output_directory(work_dir, "--work-dir")
