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


def test_another_file_of_the_embedded_model_gets_its_shipped_drafts_by_default(target_location, tmp_path):
    """Another quantisation of the embedded model (here the same file under another name, as a
    user's own download or requantisation is named) takes the shipped head, draft and corpus by
    default, as the embedded file does; nothing is shipped for a model of other shapes."""
    from specfork.loading.resolve import resolve_corpus, shipped_for

    other = tmp_path / "SmolLM2-135M-Instruct-IQ4_XS.gguf"
    other.symlink_to(target_location.path)
    location = resolve_checkpoint(str(other))
    assert location.path.name not in SHIPPED_DRAFTS
    assert shipped_for(location) == target_location.path.name
    assert resolve_draft(None, location) == resolve_draft(None, target_location) == str(shipped_drafts_dir() / HEAD)
    assert resolve_draft(None, location, heads=False) == str(shipped_drafts_dir() / "smollm2-135m-draft.gguf")
    assert resolve_corpus(None, location) == resolve_corpus(None, target_location) is not None


def test_same_model_needs_the_shapes_the_tokens_and_the_chat_template():
    """What tells another file of the embedded model from another model: each part alone refuses."""
    import dataclasses
    from types import SimpleNamespace

    from specfork.loading import load_vocabulary
    from specfork.loading.resolve import same_model

    ours = load_vocabulary("smollm2-135m")
    vocab, template = dict(ours.tokenizer.vocab), ours.tokenizer.chat_template

    def model(arch=ours.arch, vocab=vocab, template=template):
        return SimpleNamespace(arch=arch, tokenizer=SimpleNamespace(vocab=vocab, chat_template=template))

    assert same_model(model(), ours)
    assert not same_model(model(arch=dataclasses.replace(ours.arch, intermediate_size=2048)), ours)
    assert not same_model(model(arch=dataclasses.replace(ours.arch, rope_theta=10000.0)), ours)
    swapped = dict(vocab)
    first, second = list(vocab)[:2]
    swapped[first], swapped[second] = vocab[second], vocab[first]
    assert not same_model(model(vocab=swapped), ours)
    assert not same_model(model(template=template + " "), ours)
    assert not same_model(model(template=None), ours)
    # Context length and EOS ids are not part of it: converters write them differently.
    assert same_model(model(arch=dataclasses.replace(ours.arch, max_position_embeddings=2048, eos_token_ids=(0, 2))),
                      ours)


@pytest.mark.slow
def test_the_embedded_model_as_an_hf_directory_gets_its_shipped_drafts(target_location, tmp_path):
    """The embedded model's config and tokenizer as transformers writes them (an HF directory of the
    same model; no weights needed to tell) take the shipped drafts by default."""
    from transformers import AutoConfig, AutoTokenizer

    from specfork.loading.resolve import shipped_for

    directory, name = target_location.path.parent, target_location.path.name
    AutoTokenizer.from_pretrained(directory, gguf_file=name).save_pretrained(tmp_path)
    AutoConfig.from_pretrained(directory, gguf_file=name).save_pretrained(tmp_path)
    location = resolve_checkpoint(str(tmp_path))
    assert shipped_for(location) == name
    assert resolve_draft(None, location) == str(shipped_drafts_dir() / HEAD)


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
