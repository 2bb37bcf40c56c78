"""Training data for a draft: prompts from ShareGPT's train split, responses by the target.

Two kinds of prompts, interleaved in a fixed, seeded order:

* ``chat``: the first user turn of a ShareGPT conversation, through the target's chat template
  (what held-out ShareGPT evaluation looks like);
* ``code``: the first lines of a fenced code block from an assistant turn, as raw text the
  target continues (what HumanEval-style code completion looks like).

Only conversations in the ``train`` split (see :mod:`specfork.datasets`) are used, so
no evaluation prompt is ever seen in training. HumanEval is never used.

The target's greedy responses are generated with specfork in shards of ``shard_size``
prompts, each saved as soon as it is done. A response is found again by its prompt's token ids,
not by its place in the list, so an interrupted run resumes where it stopped and a run asking for
more prompts (a larger ``num_prompts``) in the same work dir generates only the new ones.
"""

from __future__ import annotations

import json
import logging
import pickle
import random
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from specfork.datasets import Prompt, sharegpt_prompts, sharegpt_records, sharegpt_split
from specfork.errors import SpecforkError

logger = logging.getLogger(__name__)

CODE_BLOCK = re.compile(r"```([A-Za-z0-9_+#-]*)\n(.*?)```", re.DOTALL)
CODE_PROMPT_MAX_CHARS = 1200
CODE_PROMPT_MIN_LINES = 2


@dataclass(frozen=True, slots=True)
class Example:
    """One training sequence: the prompt's ids and the target's response ids."""

    source: str
    id: str
    prompt_ids: list[int]
    response_ids: list[int]


def code_prompts(seed: int) -> list[Prompt]:
    """Raw code prompts: the first part of each fenced code block in ShareGPT train answers.

    A block contributes its first 30-60% of lines (at least two lines, at most
    ``CODE_PROMPT_MAX_CHARS`` characters); the cut point is drawn from ``seed`` and the block's
    position, so the set is reproducible."""
    rng = random.Random(seed)
    out: list[Prompt] = []
    for record in sharegpt_records():
        cid = str(record.get("id"))
        if sharegpt_split(cid) != "train":
            continue
        for turn in record.get("conversations") or []:
            if turn.get("from") != "gpt":
                continue
            for n, match in enumerate(CODE_BLOCK.finditer(turn.get("value") or "")):
                lines = match.group(2).splitlines(keepends=True)
                if len(lines) < 2 * CODE_PROMPT_MIN_LINES:
                    continue
                cut = max(CODE_PROMPT_MIN_LINES, int(len(lines) * rng.uniform(0.3, 0.6)))
                text = "".join(lines[:cut])[:CODE_PROMPT_MAX_CHARS]
                if text.strip():
                    lang = match.group(1).lower() or "unknown"
                    out.append(Prompt("sharegpt-code", f"{cid}/{n}/{lang}", text=text))
    return out


def training_prompts(num_prompts: int, seed: int, code_fraction: float = 0.5) -> list[Prompt]:
    """``num_prompts`` train-split prompts, ``code_fraction`` of them code, in a seeded order.

    Python blocks come first among the code prompts (HumanEval-style completion is Python),
    then blocks in other languages."""
    if not 0.0 <= code_fraction <= 1.0:
        raise ValueError(f"code_fraction must be in [0, 1], got {code_fraction}")
    chat = sharegpt_prompts("train")
    code = code_prompts(seed) if code_fraction > 0 else []
    rng = random.Random(seed)
    rng.shuffle(chat)
    rng.shuffle(code)
    code.sort(key=lambda p: not p.id.endswith(("/python", "/py")))
    n_code = min(len(code), round(num_prompts * code_fraction))
    n_chat = min(len(chat), num_prompts - n_code)
    mixed = chat[:n_chat] + code[:n_code]
    rng.shuffle(mixed)
    return mixed


def without_earlier(prompts: list[Prompt], skip_prompts: int, seed: int, code_fraction: float = 0.5) -> list[Prompt]:
    """``prompts`` (a ``training_prompts`` selection) less those of ``training_prompts(skip_prompts)``
    (an earlier run's), in their order. The selection grows by prefixes, so what remains is new;
    prompts are compared by content, since a prompt's id is not unique (a conversation id repeats
    across its code blocks, and ShareGPT repeats conversations)."""
    def key(p: Prompt) -> tuple:
        return p.dataset, p.id, p.text, repr(p.messages)

    earlier = {key(p) for p in training_prompts(skip_prompts, seed, code_fraction)}
    return [p for p in prompts if key(p) not in earlier]


def shard_path(data_dir: Path, index: int) -> Path:
    return data_dir / f"shard_{index:05d}.pt"


def tokenize(tokenizer, prompt: Prompt) -> list[int]:
    """A prompt's ids before any length check (training prompts are cut to length after)."""
    if tokenizer is None:
        raise SpecforkError("the target has no tokenizer; draft training needs one to encode its prompts")
    if prompt.messages is not None:
        return tokenizer.apply_chat_template(list(prompt.messages))
    return tokenizer.encode(prompt.text)


GROWABLE = ("num_prompts",)  # settings a work dir's shards may differ in: more prompts only add shards


def check_manifest(data_dir: Path, manifest: dict) -> None:
    """Store ``manifest`` (the settings that decide the shards' contents) beside them, or refuse
    one that differs from the stored one in anything but the ``GROWABLE`` settings."""
    manifest = {k: v for k, v in manifest.items() if k not in GROWABLE}
    path = data_dir / "manifest.json"
    if path.exists():
        saved = {k: v for k, v in json.loads(path.read_text()).items() if k not in GROWABLE}
        if saved != manifest:
            diff = {k: (saved.get(k), manifest.get(k)) for k in set(saved) | set(manifest) if saved.get(k) != manifest.get(k)}
            raise SpecforkError(
                f"{data_dir} holds data generated with other settings {diff} (saved, requested); "
                "use another --work-dir or the same settings"
            )
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True))


def next_shard_index(directory: Path) -> int:
    """The index of the next shard to write under ``directory`` (0 when it holds none)."""
    return 1 + max((int(p.stem.split("_")[1]) for p in directory.glob("shard_*.pt")), default=-1)


def load_shard(path: Path, mmap: bool = False):
    """A shard of a work dir (tensors and plain data only), or a clear error naming a damaged one."""
    try:
        return torch.load(path, weights_only=True, mmap=mmap)
    except (RuntimeError, OSError, EOFError, pickle.UnpicklingError) as e:
        raise SpecforkError(f"{path} cannot be read ({str(e).splitlines()[0]}); it is damaged: remove it (the next "
                            "run computes what it held again) or use another --work-dir") from None


def load_examples(data_dir: Path) -> list[Example]:
    examples: list[Example] = []
    for path in sorted(data_dir.glob("shard_*.pt")):
        for row in load_shard(path):
            examples.append(Example(row["source"], row["id"], row["prompt_ids"], row["response_ids"]))
    return examples


def generate_examples(
    llm,
    prompts: list[Prompt],
    data_dir: Path,
    *,
    max_new_tokens: int,
    max_prompt_tokens: int,
    manifest: dict,
    shard_size: int = 64,
    progress: bool = True,
) -> list[Example]:
    """Greedy target responses for ``prompts`` (in their order), saved shard by shard under ``data_dir``.

    Responses already on disk are kept and found by their prompt's ids, so calling this again
    after an interruption, or with more prompts, only generates what is missing; ``manifest``
    (the settings that decide the data) is stored beside them, and other settings are refused.
    Prompts longer than ``max_prompt_tokens`` keep their last ``max_prompt_tokens`` tokens."""
    from tqdm import tqdm

    from specfork.sampling_params import SamplingParams

    data_dir.mkdir(parents=True, exist_ok=True)
    check_manifest(data_dir, manifest)
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    ids = [tuple(tokenize(llm.tokenizer, p)[-max_prompt_tokens:]) for p in prompts]
    responses = {tuple(e.prompt_ids): e.response_ids for e in load_examples(data_dir)}
    missing = list({i: p for p, i in zip(prompts, ids, strict=True) if i not in responses}.items())
    logger.info("target responses: %d prompts to answer, the other %d of %d already answered under %s",
                len(missing), len(prompts) - len(missing), len(prompts), data_dir)
    bar = tqdm(total=len(missing), desc="target responses", unit="prompt", disable=not progress)
    index = next_shard_index(data_dir)
    tokens = 0
    for start in range(0, len(missing), shard_size):
        shard = missing[start : start + shard_size]
        outputs = llm.generate([list(i) for i, _ in shard], params)
        rows = [
            {"source": p.dataset, "id": p.id, "prompt_ids": list(i), "response_ids": o.token_ids}
            for (i, p), o in zip(shard, outputs, strict=True)
        ]
        path = shard_path(data_dir, index)
        tmp = path.with_suffix(".tmp")
        torch.save(rows, tmp)
        tmp.replace(path)
        index += 1
        responses.update((i, o.token_ids) for (i, _), o in zip(shard, outputs, strict=True))
        tokens += sum(len(o.token_ids) for o in outputs)
        bar.update(len(shard))
        bar.set_postfix(new_tokens=tokens)
    bar.close()
    return [Example(p.dataset, p.id, list(i), responses[i]) for p, i in zip(prompts, ids, strict=True)]
