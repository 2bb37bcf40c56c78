"""Distil a small Llama-architecture draft from a target model.

The draft shares the target's tokenizer and vocabulary (so it can propose tokens the target
verifies directly, and llama.cpp accepts it as a draft). It is trained with cross-entropy on
the target's own greedy responses, i.e. to predict the token the target would pick, which is
what greedy speculative decoding accepts. Its tied embedding is initialised from the target's
embedding projected on its top ``hidden_size`` singular directions.

Training runs on transformers' ``LlamaForCausalLM`` (autograd, standard HF checkpoint
format); specfork loads the result like any HF checkpoint. Checkpoints are written every
``checkpoint_every`` steps and a rerun with the same settings resumes from the last one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import pickle
import random
import shutil
import tempfile
import time
from array import array
from dataclasses import asdict
from pathlib import Path

import torch

from specfork.errors import SpecforkError
from specfork.training.data import Example
from specfork.training.settings import DraftArch, TrainSettings

logger = logging.getLogger(__name__)

EVAL_BUCKETS = 13  # of 256: the share of generated examples kept out of training (~5%)


def is_eval_example(example: Example) -> bool:
    return hashlib.sha1(example.id.encode("utf-8")).digest()[0] < EVAL_BUCKETS


def build_draft(target, arch: DraftArch):
    """A transformers Llama draft for ``target`` (a specfork LoadedModel), embedding initialised
    from the target's by truncated SVD."""
    from transformers import LlamaConfig, LlamaForCausalLM

    t = target.arch
    eos = list(t.eos_token_ids)
    config = LlamaConfig(
        vocab_size=t.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads,
        num_key_value_heads=arch.num_kv_heads,
        head_dim=arch.hidden_size // arch.num_heads,
        max_position_embeddings=t.max_position_embeddings,
        rms_norm_eps=t.rms_norm_eps,
        rope_theta=t.rope_theta,
        tie_word_embeddings=True,
        bos_token_id=t.bos_token_id,
        eos_token_id=eos[0] if len(eos) == 1 else (eos or None),
        attention_bias=False,
        mlp_bias=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        embedding = target.model.embed_tokens.weight.detach().float().cpu()
        u, s, _ = torch.linalg.svd(embedding, full_matrices=False)
        width = min(arch.hidden_size, s.numel())
        init = torch.zeros(embedding.shape[0], arch.hidden_size)
        init[:, :width] = u[:, :width] * s[:width]
        init *= embedding.std() / init.std()
        model.model.embed_tokens.weight.copy_(init)
    return model


def make_batches(examples: list[Example], max_seq_len: int, batch_tokens: int, seed: int) -> list[list[int]]:
    """Indices of ``examples`` grouped into padded batches of at most ``batch_tokens`` tokens,
    similar lengths together, batch order shuffled by ``seed``."""
    lengths = [min(len(e.prompt_ids) + len(e.response_ids), max_seq_len) for e in examples]
    rng = random.Random(seed)
    order = sorted(range(len(examples)), key=lambda i: (lengths[i], rng.random()))
    batches, current, longest = [], [], 0
    for i in order:
        longest_if_added = max(longest, lengths[i])
        if current and longest_if_added * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, longest_if_added = [], lengths[i]
        current.append(i)
        longest = longest_if_added
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def collate(examples: list[Example], max_seq_len: int, pad_id: int):
    """Input ids, attention mask and labels (-100 outside the responses), right-padded.
    A sequence over ``max_seq_len`` loses prompt tokens from the left first."""
    rows, labels = [], []
    for e in examples:
        response = e.response_ids[:max_seq_len - 1]
        prompt = e.prompt_ids[-(max_seq_len - len(response)) :]
        ids = prompt + response
        rows.append(ids)
        labels.append([-100] * len(prompt) + response)
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    target = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (ids, lab) in enumerate(zip(rows, labels, strict=True)):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1
        target[i, : len(lab)] = torch.tensor(lab)
    # Position t predicts token t + 1.
    return input_ids, mask, target[:, 1:]


def batch_loss(model, input_ids, mask, labels) -> tuple[torch.Tensor, int, int]:
    """Mean cross-entropy over response tokens, the number of them, and how many the draft's
    argmax got right. The output head runs only where there is a label."""
    hidden = model.model(input_ids=input_ids, attention_mask=mask).last_hidden_state[:, :-1]
    where = labels != -100
    logits = model.lm_head(hidden[where])
    target = labels[where]
    loss = torch.nn.functional.cross_entropy(logits, target)
    correct = int((logits.argmax(-1) == target).sum())
    return loss, int(target.numel()), correct


def check_schedule(total_steps: int, settings: TrainSettings) -> None:
    """Warn when the warm-up outlasts the run: the learning rate would never reach --lr."""
    if settings.warmup_steps >= total_steps:
        logger.warning("--warmup-steps %d is not shorter than this run's %d steps: the learning rate peaks at %.3g, "
                       "not --lr %.3g; lower --warmup-steps for a run this short", settings.warmup_steps, total_steps,
                       learning_rate(total_steps - 1, total_steps, settings), settings.lr)


def learning_rate(step: int, total: int, settings: TrainSettings) -> float:
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(1, total - settings.warmup_steps)
    floor = settings.lr * settings.min_lr_ratio
    return floor + (settings.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def set_learning_rate(optimizer, step: int, total: int, settings: TrainSettings) -> float:
    lr = learning_rate(step, total, settings)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def adamw(model, settings: TrainSettings) -> torch.optim.AdamW:
    """AdamW (0.9, 0.95) with weight decay on matrices only (not on norms, biases or vectors)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=settings.lr,
        betas=(0.9, 0.95),
    )


def optimizer_step(model, optimizer, loss: torch.Tensor, grad_clip: float) -> None:
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()


def write_checkpoint(directory: Path, state: dict) -> None:
    """``state`` (tensors and plain data) as ``directory/last.pt``, replaced atomically."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / "last.pt.tmp"
    torch.save(state, tmp)
    tmp.replace(directory / "last.pt")


def examples_digest(examples: list[Example]) -> str:
    """A digest of training sequences (their token ids, in order): what a checkpoint was trained
    on, so that it resumes on that data only."""
    digest = hashlib.sha256()
    for e in examples:
        for ids in (e.prompt_ids, e.response_ids):
            digest.update(array("q", ids).tobytes())
            digest.update(b"|")
    return digest.hexdigest()


def read_checkpoint(directory: Path, device, settings: dict, data: dict | None = None) -> dict | None:
    """The state in ``directory/last.pt`` (None: there is none), if it was written with
    ``settings`` and trained on ``data`` (digests; a checkpoint older than that record is taken
    as it is)."""
    path = directory / "last.pt"
    if not path.exists():
        return None
    try:
        # Tensors and plain data only: unpickling arbitrary objects could run any code.
        state = torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError:
        raise SpecforkError(
            f"{path} holds objects other than tensors and plain data; it is not loaded (a checkpoint "
            "written by this trainer never does), remove it or use another --work-dir"
        ) from None
    except (RuntimeError, OSError, EOFError) as e:
        raise SpecforkError(f"{path} cannot be read ({e}); it is damaged (an interrupted copy?): remove it to "
                            "train from the start, or use another --work-dir") from None
    if state["settings"] != settings:
        changed = _differences(state["settings"], settings)
        raise SpecforkError(
            f"{path} was written with other training settings ({', '.join(changed)}); use the same settings to "
            f"resume, remove {directory} to train afresh, or use another --work-dir"
        )
    if data is not None and state.get("data", data) != data:
        kept = path.with_name(f"last.other-data-{state['step']}-steps.pt")
        path.replace(kept)
        logger.warning("%s was trained on other data (%s differ: --num-prompts, --skip-prompts or the data options "
                       "changed); training starts afresh on this data, the old checkpoint kept as %s",
                       path, ", ".join(_differences(state["data"], data)), kept.name)
        return None
    return state


def _differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    """The keys whose values differ between two records (nested records by their dotted keys)."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key} {a!r} -> {b!r}" if not isinstance(a, str) or len(a) < 40 else f"{prefix}{key}")
    return out


@torch.no_grad()
def evaluate_tokens(model, examples: list[Example], settings: TrainSettings, pad_id: int, device) -> dict:
    """Loss and top-1 agreement with the target on held-out examples."""
    model.eval()
    total_loss, total_tokens, total_correct = 0.0, 0, 0
    for batch in make_batches(examples, settings.max_seq_len, settings.batch_tokens, seed=0):
        ids, mask, labels = (t.to(device) for t in collate([examples[i] for i in batch], settings.max_seq_len, pad_id))
        loss, n, correct = batch_loss(model, ids, mask, labels)
        total_loss += float(loss) * n
        total_tokens += n
        total_correct += correct
    model.train()
    if not total_tokens:
        return {"eval_tokens": 0}
    return {
        "eval_tokens": total_tokens,
        "eval_loss": total_loss / total_tokens,
        "eval_top1_agreement": total_correct / total_tokens,
    }


class DraftTrainer:
    """Trains ``model`` on ``examples`` with checkpoints under ``checkpoint_dir``."""

    def __init__(self, model, examples: list[Example], settings: TrainSettings, checkpoint_dir: Path, pad_id: int, device):
        self.model = model.to(device)
        self.settings = settings
        self.device = device
        self.pad_id = pad_id
        self.checkpoint_dir = checkpoint_dir
        self.train = [e for e in examples if not is_eval_example(e)]
        self.held_out = [e for e in examples if is_eval_example(e)]
        if not self.train:
            raise SpecforkError("no training examples: generate more data (--num-prompts)")
        per_epoch = len(make_batches(self.train, settings.max_seq_len, settings.batch_tokens, settings.seed))
        self.steps_per_epoch = per_epoch
        self.total_steps = max(1, math.ceil(per_epoch * settings.epochs))
        check_schedule(self.total_steps, settings)
        self.optimizer = adamw(self.model, settings)
        self.data = {"examples": examples_digest(examples)}
        self.step = 0
        self.history: list[dict] = []

    def _batches_of_epoch(self, epoch: int) -> list[list[int]]:
        return make_batches(self.train, self.settings.max_seq_len, self.settings.batch_tokens, self.settings.seed + epoch)

    def save_checkpoint(self) -> None:
        write_checkpoint(self.checkpoint_dir, {
            "step": self.step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "history": self.history,
            "settings": asdict(self.settings),
            "data": self.data,
        })

    def try_resume(self) -> bool:
        state = read_checkpoint(self.checkpoint_dir, self.device, asdict(self.settings), self.data)
        if state is None:
            return False
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = state["step"]
        self.history = state["history"]
        logger.info("resuming draft training at step %d of %d", self.step, self.total_steps)
        return True

    def run(self, progress: bool = True, until_step: int | None = None) -> list[dict]:
        """Train to the end (or to ``until_step``, for a partial run), checkpointing on the way."""
        from tqdm import tqdm

        s = self.settings
        stop = self.total_steps if until_step is None else min(until_step, self.total_steps)
        torch.manual_seed(s.seed + self.step)
        self.model.train()
        bar = tqdm(total=self.total_steps, initial=self.step, desc="training draft", unit="step", disable=not progress)
        while self.step < stop:
            epoch, index = divmod(self.step, self.steps_per_epoch)
            batch = self._batches_of_epoch(epoch)[index]
            ids, mask, labels = (
                t.to(self.device) for t in collate([self.train[i] for i in batch], s.max_seq_len, self.pad_id)
            )
            lr = set_learning_rate(self.optimizer, self.step, self.total_steps, s)
            started = time.perf_counter()
            loss, n, correct = batch_loss(self.model, ids, mask, labels)
            optimizer_step(self.model, self.optimizer, loss, s.grad_clip)
            self.step += 1
            record = {
                "step": self.step,
                "loss": float(loss.detach()),
                "top1": correct / n,
                "tokens": n,
                "lr": lr,
                "seconds": time.perf_counter() - started,
            }
            record_step(self.history, bar, record)
            if self.step % s.checkpoint_every == 0 or self.step == stop:
                self.save_checkpoint()
        bar.close()
        return self.history


def record_step(history: list[dict], bar, record: dict) -> None:
    """Keep one optimizer step's record and show it on the progress bar."""
    history.append(record)
    bar.update(1)
    bar.set_postfix(loss=f"{record['loss']:.3f}", top1=f"{record['top1']:.2f}", lr=f"{record['lr']:.1e}")


def save_draft(model, tokenizer, output: Path, provenance: dict, progress: bool = True) -> None:
    """Write ``output`` as an HF checkpoint directory: config, safetensors, tokenizer, and
    ``specfork_draft.json`` saying how it was made. Without ``progress``, transformers' own bar
    ("Writing model shards") stays off too."""
    from transformers.utils import logging as hf_logging

    def write(tmp: Path) -> None:
        shown = hf_logging.is_progress_bar_enabled()
        if shown and not progress:
            hf_logging.disable_progress_bar()
        try:
            model.save_pretrained(tmp, safe_serialization=True)
        finally:
            if shown and not progress:
                hf_logging.enable_progress_bar()
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / "specfork_draft.json").write_text(json.dumps(provenance, indent=2, sort_keys=True, default=str))

    publish_directory(output, write)


def publish_directory(output: Path, write) -> None:
    """``write(tmp)`` fills a fresh directory beside ``output``, which then replaces ``output``
    (an interrupted save leaves the previous one, never half of one). The fresh directory has a
    name of its own (hidden, unique), so no directory of the user's is ever taken for it."""
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.saving-", dir=output.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would become the published directory's
    try:
        write(tmp)
        if output.exists():
            shutil.rmtree(output)
        tmp.replace(output)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
