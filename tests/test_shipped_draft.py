"""The draft shipped for the embedded model: vocabulary, size, exact SD, real acceptance."""

from __future__ import annotations

import pytest

from specfork import LLM, SamplingParams
from specfork.errors import SpecforkError
from specfork.loading.resolve import SHIPPED_DRAFTS, resolve_checkpoint, resolve_draft, shipped_drafts_dir

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    [{"role": "user", "content": "Give me three tips for writing clear emails."}],
    [{"role": "user", "content": "Write a Python function that reverses a linked list."}],
]


@pytest.fixture(scope="module")
def target_location():
    return resolve_checkpoint("smollm2-135m")


PARAMS = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def ar_reference():
    """(prompt ids, AR's deterministic greedy outputs) shared by the SD and SSD checks."""
    ar = LLM(deterministic=True)
    ids = [ar.engine.encode_chat(p) if isinstance(p, list) else ar.engine.encode_prompt(p) for p in PROMPTS]
    return ids, [o.token_ids for o in ar.generate(ids, PARAMS)]


def test_shipped_draft_is_small_and_shares_the_target_vocabulary(target_location):
    from specfork.loading.gguf_file import GGUFFile

    assert "smollm2-135m-draft.gguf" in SHIPPED_DRAFTS[target_location.path.name]
    path = shipped_drafts_dir() / "smollm2-135m-draft.gguf"
    # By its name, and as the default of users that cannot run an EAGLE-3 head (SSD, transformers).
    assert resolve_draft("smollm2-135m-draft", target_location) == str(path)
    assert resolve_draft(None, target_location, heads=False) == resolve_draft("default", target_location, heads=False)
    assert resolve_draft(None, target_location, heads=False) == str(path)
    with pytest.raises(SpecforkError, match="does not exist; give a draft's path or one of the shipped drafts: default, "):
        resolve_draft("smollm2-135m-drfat", target_location)  # a misspelt name used to surface as a model error
    assert path.stat().st_size <= 25 * 1024 * 1024
    draft, target = GGUFFile(path), GGUFFile(target_location.path)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.eos_token_id"):
        assert draft.get(key) == target.get(key), key


def test_sd_with_the_shipped_draft_reproduces_ar_exactly(ar_reference):
    ids, expected = ar_reference
    params = PARAMS
    sd = LLM(mode="sd", k=5, draft="smollm2-135m-draft", deterministic=True)
    outputs = sd.generate(ids, params)
    assert [o.token_ids for o in outputs] == expected
    from specfork.outputs import aggregate_metrics

    # A trained draft, not a random one: a random draft of the same shape gets 1.00 here
    # (measured), the shipped one 1.32.
    assert aggregate_metrics(outputs)["mean_accepted_length"] > 1.15


@pytest.mark.dist
@pytest.mark.parametrize("draft", ["smollm2-135m-draft", None])  # None: the default, the shipped head
def test_ssd_with_the_shipped_drafts_reproduces_ar_exactly(ar_reference, draft):
    from specfork.outputs import aggregate_metrics

    ids, expected = ar_reference
    with LLM(mode="ssd", k=5, draft=draft, deterministic=True) as ssd:
        assert ssd.engine.step_strategy.proposer.feature_layers == (() if draft else (2, 15, 27))
        outputs = ssd.generate(ids, PARAMS)
        assert ssd.engine.step_strategy.proposer.failure is None
    assert [o.token_ids for o in outputs] == expected
    metrics = aggregate_metrics(outputs)
    assert metrics["ssd_cache_hit_rate"] > 0.1
    assert metrics["mean_accepted_length"] > 1.15  # the drafts are the trained draft's, not noise


def test_default_draft_for_another_target_is_a_clear_error(tiny_checkpoints):
    with pytest.raises(SpecforkError, match="ships no default draft") as error:
        LLM(str(tiny_checkpoints["llama-gqa-tied"].path), mode="sd")
    assert "smollm2-135m-eagle3" in str(error.value)  # named, for another quantisation of the embedded model


HEAD = "smollm2-135m-eagle3"


def test_the_shipped_eagle3_head_is_the_default_small_and_in_the_ecosystem_layout(target_location):
    import json

    from specfork.loading.eagle3 import read_eagle3_config

    path = shipped_drafts_dir() / HEAD
    assert resolve_draft(None, target_location) == resolve_draft(HEAD, target_location) == str(path)
    assert sum(f.stat().st_size for f in path.iterdir()) <= 15 * 1000 * 1000
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    head = read_eagle3_config(path)
    assert head.arch.vocab_size == 49152 and head.draft_vocab_size in (4096, 8192, 16384)
    assert json.loads((path / "specfork_draft.json").read_text())["target"] == "smollm2-135m"


def test_sd_with_the_shipped_head_reproduces_ar_exactly(ar_reference):
    from specfork.outputs import aggregate_metrics

    ids, expected = ar_reference
    sd = LLM(mode="sd", k=5, deterministic=True)  # no draft given: the shipped head
    assert sd.engine.step_strategy.proposer.feature_layers == (2, 15, 27)
    outputs = sd.generate(ids, PARAMS)
    assert [o.token_ids for o in outputs] == expected
    # A trained head (1.37 measured here); a random head of the same shape is accepted about never.
    assert aggregate_metrics(outputs)["mean_accepted_length"] > 1.2
