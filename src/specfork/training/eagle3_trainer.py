"""Training an EAGLE-3 head on stored target features (``eagle3_features``) with the TTT loss
(``eagle3_head``): batches of similar-length sequences, AdamW with a cosine schedule (as the
draft trainer), checkpoints every ``checkpoint_every`` steps and at the end, and a rerun with the
same settings resuming from the last one.

At every checkpoint the head is measured on the held-out examples: per unroll step, the share of
predictions whose argmax is the target's own token (top-1 agreement, an acceptance curve), and
the mean run of correct steps from step 0, which is the number of drafted tokens greedy SD with
k = ``ttt_steps`` would accept there (the tokens a chain feeds itself are the target's as long as
it is right, so the run is exact, not an estimate; positions near a sequence's end count short).
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from dataclasses import asdict
from pathlib import Path

import torch

from specfork.errors import SpecforkError
from specfork.training.data import Example
from specfork.training.eagle3_features import FeatureStore
from specfork.training.eagle3_head import Batch, Eagle3TrainHead, TTTResult, ttt_loss
from specfork.training.settings import Eagle3Settings, TrainSettings
from specfork.training.trainer import (
    adamw,
    check_schedule,
    examples_digest,
    is_eval_example,
    make_batches,
    optimizer_step,
    read_checkpoint,
    record_step,
    set_learning_rate,
    write_checkpoint,
)

logger = logging.getLogger(__name__)


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """bfloat16 where the head's matrix products should run in it (None: float32)."""
    if precision == "fp32":
        return None
    if precision == "bf16" or device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if native_bf16_cpu() else None


BF16_INSTRUCTIONS = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch.cpu's checks


def native_bf16_cpu() -> bool:
    """Whether this CPU has bfloat16 instructions (AVX-512 BF16 or AMX). oneDNN's own answer
    (``torch.ops.mkldnn._is_mkldnn_bf16_supported``) is also yes on AVX-512 CPUs without them,
    where it emulates bf16: on a 2-core Intel Xeon the head's products then ran at 51-56 GFLOP/s
    against 118-286 in float32, and a training step took 15 s."""
    try:
        return any(getattr(torch.cpu, name)() for name in BF16_INSTRUCTIONS if hasattr(torch.cpu, name))
    except RuntimeError:
        return False


def collate_features(store: FeatureStore, indices: list[int], device) -> Batch:
    """The stored sequences ``indices``, right-padded into one batch (float32 on ``device``)."""
    records = [store.record(i) for i in indices]
    width = max(len(r["ids"]) for r in records)
    first = records[0]
    ids = torch.zeros(len(records), width, dtype=torch.long)
    features = torch.zeros(len(records), width, first["features"].shape[1])
    hidden = torch.zeros(len(records), width, first["hidden"].shape[1])
    for b, r in enumerate(records):
        n = len(r["ids"])
        ids[b, :n] = r["ids"]
        features[b, :n] = r["features"]
        hidden[b, :n] = r["hidden"]
    lengths = torch.tensor([len(r["ids"]) for r in records])
    prompt_lens = torch.tensor([int(r["prompt_len"]) for r in records])
    return Batch(*(t.to(device) for t in (ids, features, hidden, lengths, prompt_lens)))


class Eagle3Trainer:
    """Trains ``head`` on the stored features of ``examples`` (``store.record(i)`` is example
    i's), with checkpoints under ``checkpoint_dir``. ``target_rows`` [N, d]: the target's LM-head
    rows of the head's draft vocabulary."""

    def __init__(self, head: Eagle3TrainHead, store: FeatureStore, examples: list[Example],
                 settings: TrainSettings, eagle: Eagle3Settings, target_rows: torch.Tensor, checkpoint_dir: Path,
                 device) -> None:
        self.head = head.to(device)
        self.store = store
        self.settings, self.eagle = settings, eagle
        self.target_rows = target_rows.to(device)
        self.checkpoint_dir, self.device = checkpoint_dir, device
        self.autocast = autocast_dtype(eagle.precision, torch.device(device))
        self.examples = examples
        usable = [i for i, e in enumerate(examples) if len(e.response_ids) >= 2]  # step 0 predicts response token 2
        self.train = [i for i in usable if not is_eval_example(examples[i])]
        self.held_out = [i for i in usable if is_eval_example(examples[i])]
        if not self.train:
            raise SpecforkError("no training examples: a head needs responses of 2 tokens or more outside the held-out "
                                "share; generate more data (--num-prompts) or longer responses (--max-new-tokens)")
        self.steps_per_epoch = len(self._batches(self.train, settings.seed))
        self.total_steps = max(1, math.ceil(self.steps_per_epoch * settings.epochs))
        check_schedule(self.total_steps, settings)
        self.optimizer = adamw(self.head, settings)
        trained_by = {k: str(v) if isinstance(v, Path) else v  # what decides the weights (plain data)
                      for k, v in asdict(eagle).items() if k != "feature_batch"}
        self.identity = {"train": asdict(settings), "eagle3": trained_by, "draft_vocab": len(head.draft_ids)}
        self.data = {"examples": examples_digest(examples),
                     "draft_ids": hashlib.sha256(head.draft_ids.cpu().numpy().astype("int64").tobytes()).hexdigest()}
        self.step = 0
        self.history: list[dict] = []
        self.curve: list[dict] = []  # the held-out evaluation at each checkpoint

    def _batches(self, indices: list[int], seed: int) -> list[list[int]]:
        """Batches of example indices (similar lengths together, order drawn from ``seed``)."""
        s = self.settings
        batches = make_batches([self.examples[i] for i in indices], s.max_seq_len, s.batch_tokens, seed)
        return [[indices[i] for i in batch] for batch in batches]

    def save_checkpoint(self) -> None:
        write_checkpoint(self.checkpoint_dir, {
            "step": self.step,
            "model": self.head.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "history": self.history,
            "curve": self.curve,
            "settings": self.identity,
            "data": self.data,
        })

    def try_resume(self) -> bool:
        state = read_checkpoint(self.checkpoint_dir, self.device, self.identity, self.data)
        if state is None:
            return False
        self.head.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.history, self.curve = state["step"], state["history"], state["curve"]
        logger.info("resuming EAGLE-3 head training at step %d of %d", self.step, self.total_steps)
        return True

    def _loss(self, batch: list[int]) -> TTTResult:
        data = collate_features(self.store, batch, self.device)
        with torch.autocast(torch.device(self.device).type, dtype=self.autocast, enabled=self.autocast is not None):
            return ttt_loss(self.head, data, self.target_rows, self.eagle.ttt_steps)

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out loss and top-1 agreement per unroll step, and the mean accepted run."""
        self.head.eval()
        steps = self.eagle.ttt_steps
        loss, correct, counted = [0.0] * steps, [0] * steps, [0] * steps
        accepted = positions = 0
        for batch in self._batches(self.held_out, seed=0):
            r = self._loss(batch)
            loss = [a + b for a, b in zip(loss, r.step_loss, strict=True)]
            correct = [a + b for a, b in zip(correct, r.correct, strict=True)]
            counted = [a + b for a, b in zip(counted, r.counted, strict=True)]
            accepted, positions = accepted + r.accepted, positions + r.positions
        self.head.train()
        return {
            "step": self.step,
            "positions": positions,
            "loss_by_step": [x / n if n else None for x, n in zip(loss, counted, strict=True)],
            "top1_by_step": [c / n if n else None for c, n in zip(correct, counted, strict=True)],
            "mean_accepted_run": accepted / positions if positions else None,
        }

    def _checkpoint(self) -> None:
        if self.held_out:
            self.curve.append(self.evaluate())
            c = self.curve[-1]
            logger.info("step %d: held-out top-1 agreement by unroll step %s, mean accepted run %.3f of %d",
                        self.step, " ".join(f"{x:.3f}" for x in c["top1_by_step"] if x is not None),
                        c["mean_accepted_run"] or 0.0, self.eagle.ttt_steps)
        self.save_checkpoint()

    def run(self, progress: bool = True, until_step: int | None = None) -> list[dict]:
        """Train to the end (or to ``until_step``, for a partial run), checkpointing on the way."""
        from tqdm import tqdm

        s = self.settings
        stop = self.total_steps if until_step is None else min(until_step, self.total_steps)
        self.head.train()
        bar = tqdm(total=self.total_steps, initial=self.step, desc="training EAGLE-3 head", unit="step",
                   disable=not progress)
        while self.step < stop:
            epoch, index = divmod(self.step, self.steps_per_epoch)
            batch = self._batches(self.train, s.seed + epoch)[index]
            lr = set_learning_rate(self.optimizer, self.step, self.total_steps, s)
            started = time.perf_counter()
            result = self._loss(batch)
            optimizer_step(self.head, self.optimizer, result.loss, s.grad_clip)
            self.step += 1
            record = {
                "step": self.step,
                "loss": float(result.loss.detach()),
                "top1": result.correct[0] / max(1, result.counted[0]),
                "tokens": result.counted[0],
                "lr": lr,
                "seconds": time.perf_counter() - started,
            }
            record_step(self.history, bar, record)
            if self.step % s.checkpoint_every == 0 or self.step == stop:
                self._checkpoint()
        bar.close()
        return self.history
