"""Corpus lookup (``--lookup-corpus``): its proposals against a plain search, collisions, the file
and its refusals, where it sits among the sources, greedy SD equal to AR with it, the target's
exact distribution when sampling with it, and the corpus shipped for the embedded model."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from lossless import NUM_TOKENS, PROMPT, SETTINGS, check, exact_joint, sampling_params

from specfork import LLM, SamplingParams
from specfork.config import Config
from specfork.engine.sequence import Sequence
from specfork.errors import ModelLoadError, SpecforkError
from specfork.loading.resolve import resolve_checkpoint, resolve_corpus
from specfork.outputs import aggregate_metrics
from specfork.speculative import corpus as corpus_module
from specfork.speculative.corpus import NGRAM_LENGTHS, SEPARATOR, LookupCorpus, load_corpus, save_corpus
from specfork.speculative.lookup_first import LookupFirstProposer
from specfork.speculative.ngram import NgramProposer
from specfork.speculative.proposer import Proposal, StatelessProposer


def plain_search(tokens: list[int], context: list[int], k: int) -> list[int]:
    """What a corpus lookup must propose, by scanning: for n longest first, the first corpus
    position whose n tokens before it equal the context's last n, none of them a separator and
    itself not one; then up to k tokens from there, stopping at a separator."""
    for n in NGRAM_LENGTHS:
        if len(context) < n:
            continue
        suffix = context[-n:]
        for end in range(n, len(tokens)):
            window = tokens[end - n : end]
            if window == suffix and SEPARATOR not in window and tokens[end] != SEPARATOR:
                follow = tokens[end : end + k]
                return follow[: follow.index(SEPARATOR)] if SEPARATOR in follow else follow
    return []


def random_corpus(rng: random.Random, vocab: int, sequences: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(rng.randrange(1, 30))] for _ in range(sequences)]


def flat(sequences: list[list[int]]) -> list[int]:
    return [t for seq in sequences for t in [*seq, SEPARATOR]]


@pytest.mark.parametrize("vocab", [3, 6, 50])
def test_proposals_equal_a_plain_search(vocab):
    rng = random.Random(vocab)
    for _ in range(5):
        tokens = flat(random_corpus(rng, vocab, 40))
        corpus = LookupCorpus(np.array(tokens))
        found = 0
        for _ in range(200):
            context = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
            k = rng.randrange(0, 7)
            expected = plain_search(tokens, context, k) if k else []
            assert corpus.propose(context, k) == expected, (context, k)
            found += bool(expected)
        assert found > 0


def test_longest_match_first_and_no_crossing_of_sequences():
    corpus = LookupCorpus(np.array(flat([[1, 2, 3, 9, 9], [7, 1, 2, 3, 4, 5, 6]])))
    assert corpus.propose([1, 2, 3], 2) == [9, 9]  # n = 3: the first occurrence
    assert corpus.propose([7, 1, 2, 3], 2) == [4, 5]  # n = 4 matches the second sequence only
    assert corpus.propose([2, 3, 9, 9], 5) == []  # the first sequence ends: nothing follows
    assert corpus.propose([9, 9, 7], 3) == []  # that 3-gram crosses the two sequences
    assert corpus.propose([4, 5], 3) == []  # shorter than every n
    assert len(corpus) == 12


def test_a_hash_collision_never_proposes_a_wrong_continuation(monkeypatch):
    """Every window hashing alike: the tokens themselves decide."""
    monkeypatch.setattr(corpus_module, "_hash_windows",
                        lambda tokens, lengths: {n: np.zeros(len(tokens) - n + 1, dtype=np.uint32) for n in lengths})
    monkeypatch.setattr(corpus_module, "_hash_window", lambda tokens: 0)
    corpus = LookupCorpus(np.array(flat([[1, 2, 3, 4], [5, 6, 7, 8]])))
    assert corpus.propose([5, 6, 7], 1) == [8]
    assert corpus.propose([6, 6, 7], 1) == []


@pytest.mark.parametrize("distinct", [3, 70_000, 2**32])
def test_the_index_sort_keeps_equal_hashes_in_corpus_order(distinct):
    """The radix sort of the index equals numpy's stable sort, ties (many here) included."""
    keys = np.random.default_rng(distinct).integers(0, distinct, size=5000, dtype=np.uint64).astype(np.uint32)
    assert np.array_equal(corpus_module._stable_argsort(keys), np.argsort(keys, kind="stable"))


def test_a_lookup_hashes_its_window_as_the_index_does():
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 2**31 - 1, size=64, dtype=np.int64).astype(np.int32)
    all_hashes = corpus_module._hash_windows(tokens, NGRAM_LENGTHS)
    for n in NGRAM_LENGTHS:
        index_hashes = all_hashes[n]
        assert len(index_hashes) == 64 - n + 1
        for i in (0, 17, 64 - n):
            assert corpus_module._hash_window(tokens[i : i + n].tolist()) == int(index_hashes[i])


def test_the_file_round_trips_and_another_vocabulary_is_refused(tmp_path):
    path = tmp_path / "corpus.npz"
    assert save_corpus(path, [[1, 2, 3], [], [4, 5]], vocab_size=10) == 5
    corpus = load_corpus(path, 10)
    assert corpus.tokens.tolist() == [1, 2, 3, SEPARATOR, 4, 5, SEPARATOR]
    with pytest.raises(SpecforkError, match="vocabulary of 10 tokens; the target has 12"):
        load_corpus(path, 12)
    (tmp_path / "bad.npz").write_bytes(b"not a corpus")
    with pytest.raises(SpecforkError, match="is not a lookup corpus"):
        load_corpus(tmp_path / "bad.npz", 10)
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object))  # pickled data: refused, never unpickled
    with pytest.raises(SpecforkError, match="is not a lookup corpus"):
        load_corpus(tmp_path / "objects.npy", 10)
    with pytest.raises(SpecforkError, match="does not exist"):
        load_corpus(tmp_path / "missing.npz", 10)


class FixedDraft(StatelessProposer):
    def propose(self, seqs, num_tokens):
        return Proposal([[7][:k] for k in num_tokens], None)


def test_prompt_lookup_first_then_the_corpus_then_the_draft():
    corpus = LookupCorpus(np.array(flat([[4, 5, 6, 1, 1], [0, 9, 9, 9]])))
    proposer = LookupFirstProposer(FixedDraft(), min_n=2, max_n=4, corpus=corpus)
    seqs = [Sequence(i, tokens, SamplingParams(temperature=0.0), torch.Generator()) for i, tokens in enumerate([
        [4, 5, 6, 4, 5],  # a repeat in the context: prompt lookup
        [8, 4, 5, 6],  # no repeat; the corpus has [4, 5, 6]
        [8, 2, 3],  # neither: the draft
    ])]
    proposal = proposer.propose(seqs, [2, 2, 2])
    assert proposal.tokens == [[6, 4], [1, 1], [7]]
    assert proposal.sources == ["lookup", "corpus", "draft"]
    ngram = NgramProposer(min_n=2, max_n=4, corpus=corpus).propose(seqs, [2, 2, 2])
    assert ngram.tokens == [[6, 4], [1, 1], []] and ngram.sources == ["lookup", "corpus", None]


@pytest.mark.parametrize("corpus_tokens, expected", [(1, [9]), (2, [9, 8]), (4, [9, 8, 7, 6])])
def test_the_corpus_proposes_at_most_corpus_tokens(corpus_tokens, expected):
    """A corpus match proposes min(k, corpus_tokens) tokens; a match in the context still k."""
    corpus = LookupCorpus(np.array(flat([[4, 5, 6, 9, 8, 7, 6, 5]])))
    seqs = [Sequence(0, [8, 4, 5, 6], SamplingParams(temperature=0.0), torch.Generator()),
            Sequence(1, [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(temperature=0.0), torch.Generator())]
    for proposer in (LookupFirstProposer(FixedDraft(), min_n=2, max_n=4, corpus=corpus, corpus_tokens=corpus_tokens),
                     NgramProposer(min_n=2, max_n=4, corpus=corpus, corpus_tokens=corpus_tokens)):
        proposal = proposer.propose(seqs, [4, 4])
        assert proposal.tokens == [expected, [3, 1, 2, 3]]
        assert proposal.sources == ["corpus", "lookup"]


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_corpus_tokens_must_be_a_positive_integer(value):
    with pytest.raises(SpecforkError, match="corpus_tokens must be an integer >= 1"):
        Config(mode="sd", corpus_tokens=value)


def _target_corpus(target, tmp_path, prompts, vocab) -> str:
    """A corpus of the target's own greedy continuations, so that it proposes and is often right."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    outs = LLM(target).generate(prompts, params)
    path = tmp_path / "corpus.npz"
    save_corpus(path, [p + o.token_ids for p, o in zip(prompts, outs, strict=True)], vocab)
    return str(path)


@pytest.mark.parametrize("drafter", ["head", "ngram"])
def test_greedy_sd_with_a_corpus_equals_ar(head_pair, tmp_path, drafter):
    rng = random.Random(3)
    seen = [[rng.randrange(8) for _ in range(4)] for _ in range(12)]
    path = _target_corpus(head_pair["target"], tmp_path, seen, 8)
    prompts = [s[:3] for s in seen[:4]] + [[2, 4], [5]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = [o.token_ids for o in LLM(head_pair["target"], deterministic=True).generate(prompts, params)]
    options = dict(draft=head_pair["draft"], lookup_first=3) if drafter == "head" else dict(drafter="ngram", ngram_min=3)
    llm = LLM(head_pair["target"], mode="sd", k=3, lookup_corpus=path, deterministic=True, **options)
    for batch in ([prompts[0]], prompts):
        outs = llm.generate(batch, params)
        assert [o.token_ids for o in outs] == expected[: len(batch)]
    corpus = aggregate_metrics(outs)["by_source"]["corpus"]
    assert corpus["rounds"] > 0 and corpus["accepted"] > 0


def test_sampling_with_corpus_lookups_is_lossless(head_pair, tmp_path):
    """Lookups (prompt and corpus, one-hot q) and the reduced-vocabulary head's drafts in one run:
    the samples follow the target's exact distribution."""
    params_kw = SETTINGS["temperature"]
    joint = exact_joint(head_pair["hf_target"], SamplingParams(**params_kw), NUM_TOKENS)
    path = tmp_path / "corpus.npz"
    save_corpus(path, random_corpus(random.Random(0), 8, 60), 8)
    n = 6000
    llm = LLM(head_pair["target"], mode="sd", draft=head_pair["draft"], k=3, lookup_first=2, lookup_corpus=str(path),
              max_num_seqs=512, kv_cache_tokens=512 * 16)
    outs = llm.generate([PROMPT] * n, [sampling_params(i, params_kw) for i in range(n)])
    by_source = aggregate_metrics(outs)["by_source"]
    assert all(by_source[s]["rounds"] > n // 20 for s in ("lookup", "corpus", "draft")), by_source
    assert 0 < by_source["corpus"]["accepted"] < by_source["corpus"]["proposed"]
    for name, (stat, dof, limit) in check([tuple(o.token_ids) for o in outs], joint).items():
        assert stat < limit, f"{name}: chi2 {stat:.1f} >= {limit:.1f} (dof {dof})"


@pytest.mark.parametrize("options, message", [
    (dict(mode="ar", lookup_corpus="c.npz"), "SD's prompt lookup"),
    (dict(mode="ssd", lookup_corpus="c.npz"), "SD's prompt lookup"),
    (dict(mode="sd", draft="my-head", lookup_corpus="c.npz"), "--lookup-first N"),
    (dict(mode="sd", lookup_first=0, lookup_corpus="default"), "--lookup-first N"),
    (dict(mode="sd", lookup_corpus=""), "a path, 'default' or 'none'"),
])
def test_a_corpus_is_refused_where_no_prompt_lookup_runs(options, message):
    with pytest.raises(SpecforkError, match=message.replace("-", r"\-")):
        Config(**options)


def test_the_embedded_model_ships_a_corpus_used_by_default(tmp_path):
    embedded = resolve_checkpoint("smollm2-135m")
    shipped = resolve_corpus(None, embedded)
    assert shipped is not None and resolve_corpus("default", embedded) == shipped
    assert resolve_corpus("none", embedded) is None
    assert len(load_corpus(shipped, 49152)) > 500_000
    with pytest.raises(ModelLoadError, match="is not a file"):
        resolve_corpus(str(tmp_path / "missing.npz"), embedded)
    with LLM(mode="sd") as llm:
        assert llm.engine.step_strategy.proposer.lookup.corpus is not None
        assert llm.engine.step_strategy.proposer.lookup.corpus_tokens == 2
    with LLM(mode="sd", drafter="ngram", corpus_tokens=3) as llm:
        assert llm.engine.step_strategy.proposer.lookup.corpus_tokens == 3
    with LLM(mode="sd", lookup_corpus="none") as llm:
        assert llm.engine.step_strategy.proposer.lookup.corpus is None
