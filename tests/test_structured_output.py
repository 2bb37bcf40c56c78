"""Structured outputs: the output follows its grammar (a JSON schema, any JSON object, a regular
expression, a list of choices), and speculation keeps it exact. Greedy SD equals AR under a
grammar; sampled SD with a draft unlike the target follows the masked target distribution,
computed exactly by enumerating the outputs of a choice grammar over a vocabulary of 8 tokens."""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter

import pytest
import torch
from lossless import EOS, PROMPT, VOCAB, chi2_quantile, chi_square, tiny_model

from specfork import LLM, SamplingParams, SpecforkError
from specfork.sampling import logits_to_probs
from specfork.sampling_params import StructuredOutputs

LETTERS = "abcdefg"  # tokens 0..6 of the tiny models; 7 is EOS
CHOICES = ("ab", "abc", "b", "bad", "ca", "cab", "gg")


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(LETTERS)} | {"<eos>": EOS}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@pytest.fixture(scope="module")
def lettered(tmp_path_factory):
    """The losslessness tests' tiny target and draft (8 tokens), with a tokenizer that spells
    tokens 0..6 as the letters a..g."""
    root = tmp_path_factory.mktemp("structured")
    target = tiny_model(root / "target", seed=11)
    tiny_model(root / "draft", seed=12)
    for name in ("target", "draft"):
        _tokenizer().save_pretrained(root / name)
    return {"target": str(root / "target"), "draft": str(root / "draft"), "hf_target": target}


def _allowed_after(prefix: str) -> set[int]:
    """The tokens the choice grammar allows after ``prefix``, written out: the letters that
    continue some choice, and EOS where the prefix is a choice."""
    allowed = {LETTERS.index(c[len(prefix)]) for c in CHOICES if c.startswith(prefix) and len(c) > len(prefix)}
    return allowed | ({EOS} if prefix in CHOICES else set())


@torch.no_grad()
def _exact_outputs(hf_model, params: SamplingParams) -> dict[str, float]:
    """P(output) for every choice, from the target's logits masked by the grammar."""
    done, frontier = {}, {"": 1.0}
    while frontier:
        prefixes = list(frontier)
        ids = torch.tensor([PROMPT + [LETTERS.index(c) for c in p] for p in prefixes])
        logits = hf_model(ids).logits[:, -1].float()
        for row, prefix in zip(logits, prefixes, strict=True):
            row[[t for t in range(VOCAB) if t not in _allowed_after(prefix)]] = float("-inf")
        n = len(prefixes)
        probs = logits_to_probs(logits, torch.full((n,), params.temperature), torch.full((n,), params.top_k),
                                torch.full((n,), params.top_p))
        nxt = {}
        for prefix, row in zip(prefixes, probs.tolist(), strict=True):
            for token, p in enumerate(row):
                if p > 0:
                    if token == EOS:
                        done[prefix] = done.get(prefix, 0.0) + frontier[prefix] * p
                    else:
                        nxt[prefix + LETTERS[token]] = frontier[prefix] * p
        frontier = nxt
    return done


def test_sampled_sd_under_a_choice_grammar_is_the_masked_target_distribution(lettered):
    """Each output is one of the choices, at the probability the target gives it once every
    token the grammar refuses is masked, in the first round and in later ones (the choices run
    to 4 tokens with EOS, k = 3: most outputs take several rounds)."""
    spec = StructuredOutputs(choice=CHOICES)
    base = dict(temperature=1.0, max_tokens=8, structured_outputs=spec)
    exact = _exact_outputs(lettered["hf_target"], SamplingParams(**base))
    assert sum(exact.values()) == pytest.approx(1.0, abs=1e-5) and set(exact) == set(CHOICES)
    n = 6000
    llm = LLM(lettered["target"], mode="sd", draft=lettered["draft"], k=3, max_num_seqs=512, kv_cache_tokens=512 * 16)
    outs = llm.generate([PROMPT] * n, [SamplingParams(**base, seed=i) for i in range(n)])
    assert all(o.finish_reason == "stop" for o in outs)
    accepted = sum(o.metrics["draft_tokens_accepted"] for o in outs)
    assert 0 < accepted < sum(o.metrics["draft_tokens_proposed"] for o in outs)
    counts = Counter("".join(LETTERS[t] for t in o.token_ids if t != EOS) for o in outs)
    assert set(counts) <= set(CHOICES), set(counts) - set(CHOICES)
    stat, dof = chi_square(counts, exact, n)
    assert stat < chi2_quantile(dof), f"chi2 {stat:.1f} >= {chi2_quantile(dof):.1f} (dof {dof}): {counts}"


@pytest.mark.parametrize("drafter", ["draft", "ngram", "ssd"])
def test_greedy_sd_under_a_grammar_equals_ar(lettered, drafter):
    """Greedy: the grammar changes the output (it would not match without it), and SD (a draft
    model, n-gram lookup) and SSD equal AR."""
    prompts = [PROMPT, [2, 2, 4], [6, 0, 1, 5]]
    grammar = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputs(regex="(ab|c)+g"))
    ar = LLM(lettered["target"], deterministic=True)
    want = [o.token_ids for o in ar.generate(prompts, grammar)]
    assert all(re.fullmatch("(ab|c)+g", "".join(LETTERS[t] for t in ids if t != EOS)) for ids in want
               if ids[-1] == EOS)
    free = [o.token_ids for o in ar.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))]
    assert free != want
    options = {"draft": {"mode": "sd", "draft": lettered["draft"]}, "ngram": {"mode": "sd", "drafter": "ngram"},
               "ssd": {"mode": "ssd", "draft": lettered["draft"]}}[drafter]
    with LLM(lettered["target"], k=3, deterministic=True, **options) as sd:
        assert [o.token_ids for o in sd.generate(prompts, grammar)] == want


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                                           "languages": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                         "maxItems": 3}},
          "required": ["name", "age", "languages"], "additionalProperties": False}
ASK = [[{"role": "user", "content": "Describe a programmer as JSON: name, age, languages."}],
       [{"role": "user", "content": "Give me a JSON object about the city of Paris."}]]


def test_the_embedded_model_follows_a_json_schema_and_sd_with_its_head_equals_ar():
    params = SamplingParams(temperature=0.0, max_tokens=96, structured_outputs=StructuredOutputs(json=SCHEMA))
    ar = LLM(deterministic=True, max_model_len=512)
    want = ar.chat(ASK, params)
    done = [o for o in want if o.finish_reason == "stop"]
    assert done, [o.text for o in want]
    for o in done:
        value = json.loads(o.text)
        assert list(value) == ["name", "age", "languages"] and isinstance(value["age"], int), value  # the schema's order
        assert len(value["name"]) <= 24 and len(value["languages"]) <= 3, value
    sd = LLM(mode="sd", deterministic=True, max_model_len=512)
    assert [o.token_ids for o in sd.chat(ASK, params)] == [o.token_ids for o in want]
    anything = SamplingParams(temperature=0.0, max_tokens=96, structured_outputs=StructuredOutputs(json_object=True))
    for o in ar.chat(ASK, anything):
        assert o.finish_reason == "length" or isinstance(json.loads(o.text), dict)


@pytest.mark.parametrize("kwargs,message", [
    (dict(), "exactly one of json, json_object, regex and choice; got none"),
    (dict(regex="a", choice=["a"]), "got regex, choice"),
    (dict(json="{not json"), "the JSON schema is not JSON"),
    (dict(json="[1]"), "must be a JSON object"),
    (dict(choice=[]), "choice must be a non-empty list"),
    (dict(regex=""), "regex must be a non-empty string"),
    (dict(json="[" * 100_000), "the JSON schema is not JSON"),  # nested too deeply (a RecursionError)
    (dict(json={"default": object()}), "the JSON schema is not JSON"),
])
def test_a_structured_output_says_what_it_wants_once(kwargs, message):
    with pytest.raises(SpecforkError, match=re.escape(message)) as e:
        StructuredOutputs(**kwargs)
    assert e.value.param == "structured_outputs"


@pytest.mark.parametrize("clash", [dict(ignore_eos=True), dict(min_tokens=2), dict(bad_words=("x",)),
                                   dict(allowed_token_ids=(1, 2))])
def test_settings_that_hold_tokens_back_are_refused_with_a_grammar(clash):
    with pytest.raises(SpecforkError, match="cannot be combined with structured outputs") as e:
        SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(json_object=True), **clash)
    assert e.value.param == next(iter(clash))


def test_a_grammar_that_does_not_compile_and_a_model_without_a_tokenizer_are_refused(lettered, tiny_checkpoints):
    llm = LLM(lettered["target"])
    bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(json={"type": "frob"}))
    with pytest.raises(SpecforkError, match="does not compile") as e:
        llm.generate([PROMPT], bad)
    assert e.value.param == "structured_outputs"
    with pytest.raises(SpecforkError, match="does not compile"):
        llm.generate([PROMPT], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(regex="(ab")))
    assert llm.generate([PROMPT], SamplingParams(max_tokens=4))[0].token_ids  # the engine goes on
    untokenized = LLM(str(tiny_checkpoints["llama-gqa-tied"].path))
    with pytest.raises(SpecforkError, match="need the model's tokenizer"):
        untokenized.generate([PROMPT], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(regex="a")))


def test_a_schema_keeps_the_order_of_its_properties():
    """Properties are generated in the schema's order (as OpenAI and vLLM do): a schema asking for
    "reasoning" before "answer" gets them so."""
    schema = {"type": "object", "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "integer"}},
              "required": ["zeta", "alpha"]}
    assert list(json.loads(StructuredOutputs(json=schema).json)["properties"]) == ["zeta", "alpha"]
    assert StructuredOutputs(json=schema) == StructuredOutputs(json=json.dumps(schema))


def test_a_tokenizer_llguidance_cannot_use_is_refused_once_and_clearly(lettered):
    """A tokenizer with more tokens than the model has logits (llguidance refuses it): a
    SpecforkError naming structured_outputs, remembered, never a raw error."""
    from specfork.structured_output import GrammarCompiler

    compiler = GrammarCompiler(LLM(lettered["target"]).engine.tokenizer, vocab_size=6, eos_token_ids=[EOS])
    for _ in range(2):
        with pytest.raises(SpecforkError, match="cannot use this model's tokenizer") as e:
            compiler.check(StructuredOutputs(regex="ab"))
        assert e.value.param == "structured_outputs"


def test_a_grammar_compiles_once_and_each_request_gets_its_own_matcher(lettered):
    """n choices of one schema (or a server's repeated schema) compile once; each sequence still
    has a matcher of its own, so one choice's tokens never move another's."""
    llm = LLM(lettered["target"])
    spec = StructuredOutputs(choice=CHOICES)
    compiler = llm.engine.grammars
    first, second = compiler.grammar(spec), compiler.grammar(spec)
    assert len(compiler._compiled) == 1 and first.matcher is not second.matcher
    first.matcher.consume_token(LETTERS.index("g"))
    assert second.matcher.consume_token(LETTERS.index("a"))  # still at the start: "a" begins "ab"
    params = SamplingParams(temperature=1.0, max_tokens=8, structured_outputs=spec)
    outs = llm.generate([PROMPT] * 8, [dataclasses.replace(params, seed=i) for i in range(8)])
    assert all("".join(LETTERS[t] for t in o.token_ids if t != EOS) in CHOICES for o in outs)
    assert len(compiler._compiled) == 1
