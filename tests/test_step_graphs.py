"""The static-shape steps that CUDA graphs replay (engine/step_graphs.py), run eagerly on the
CPU: inputs copied into fixed buffers, the context padded to a power-of-two key bucket through
block 0, shorter windows and the batch padded with rows that write the scratch block, the causal
mask built from the positions. Against the same runner's ordinary path (reference attention on
both sides): bit for bit in deterministic mode, within float rounding otherwise, keys and values
included. The replay itself is tested on a GPU (tests/test_cuda.py)."""

import pytest
import torch
from helpers import head_step_inputs, step_logits

from specfork import LLM, SamplingParams
from specfork.engine.step_graphs import MIN_KEYS, _bucket

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
PROMPTS = [[1, 5, 9, 13, 2, 7], [1, 44, 3], [1, 8, 8, 8, 8, 8, 8, 20, 21, 3, 4, 5, 6, 7]]


def _llm(path: str, *, static: bool, **options) -> LLM:
    llm = LLM(path, **options)
    runner = llm.engine.runner
    runner.native_attention_available = False  # both sides on the reference attention
    if static:
        runner.graphs = runner.static_steps(max_seqs=4, max_rows=6, capture=False)
    return llm


def _step(llm, prompts, windows):
    logits, caches = step_logits(llm, prompts, windows)
    return logits[0], caches


def _counting(graphs) -> list:
    """Record what each ``graphs.run`` returned (None: the step ran the ordinary path)."""
    answers = []
    run = graphs.run
    graphs.run = lambda *a: answers.append(out := run(*a)) or out
    return answers


WINDOWS = [[[4]], [[4], [9], [2]], [[4, 5, 6, 7]], [[4, 5, 6], [9, 9, 9], [2, 3, 1]],
           [[4, 5], [9], [2, 3, 1]]]  # the last: windows of different lengths, padded to the longest


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("windows", WINDOWS)
def test_static_step_equals_the_ordinary_step(tiny_checkpoints, deterministic, windows):
    path = str(tiny_checkpoints["llama-gqa-tied"].path)
    prompts = PROMPTS[: len(windows)]
    static = _llm(path, static=True, deterministic=deterministic)
    graphs = static.engine.runner.graphs
    answers, shapes = _counting(graphs), []
    forward = graphs._static_forward
    graphs._static_forward = lambda shape: shapes.append(shape) or forward(shape)
    got, got_caches = _step(static, prompts, windows)
    want, want_caches = _step(_llm(path, static=False, deterministic=deterministic), prompts, windows)
    assert len(answers) == 1 and answers[0] is not None, "the step did not take the static path"
    # (sequences, rows) of the graph: three sequences padded to four, windows to the longest
    assert shapes[0][:2] == (1 if len(windows) == 1 else 4, max(len(w) for w in windows))
    # the last block is the scratch block the padded rows write; no sequence reads it
    got_caches, want_caches = [c[:, :-1] for c in got_caches], [c[:, :-1] for c in want_caches]
    if deterministic:  # masked padding adds exact zeros on the batch-invariant path
        assert torch.equal(got, want)
        assert all(torch.equal(a, b) for a, b in zip(got_caches, want_caches, strict=True))
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for a, b in zip(got_caches, want_caches, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_uneven_windows_without_a_scratch_slot_run_eagerly(tiny_checkpoints):
    path = str(tiny_checkpoints["llama-gqa-tied"].path)
    static = _llm(path, static=True, deterministic=True)
    static.engine.runner.graphs.scratch_slot = None
    answers = _counting(static.engine.runner.graphs)
    windows = [[4, 5], [9], [2, 3, 1]]
    got, _ = _step(static, PROMPTS, windows)
    want, _ = _step(_llm(path, static=False, deterministic=True), PROMPTS, windows)
    assert answers == [None]
    assert torch.equal(got, want)


@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_greedy_generation_on_static_steps_equals_ar(tiny_checkpoints, mode):
    path = str(tiny_checkpoints["llama-gqa-tied"].path)
    ar = _llm(path, static=False, deterministic=True).generate(PROMPTS, GREEDY)
    options = {"mode": "sd", "drafter": "ngram", "k": 4} if mode == "sd" else {}
    out = _llm(path, static=True, deterministic=True, **options).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in out] == [o.token_ids for o in ar]


def test_key_buckets():
    assert _bucket(1, 16) == MIN_KEYS
    assert _bucket(MIN_KEYS, 16) == MIN_KEYS
    assert _bucket(MIN_KEYS + 1, 16) == 2 * MIN_KEYS
    assert _bucket(300, 24) == 528  # 512 rounded up to whole blocks of 24


HEAD_PROMPTS = [[1, 3, 5], [2, 4], [6, 1, 1, 0, 3], [5]]
HEAD_GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("drafter", ["head", "draft"])
def test_drafting_steps_on_static_steps(head_pair, draft_pair, drafter):
    """The drafting loop's steps on the static path: an EAGLE-3 head's (its hidden states a
    further static input) and a draft model's. SD's greedy output still equals AR, and the
    drafting steps took the static path."""
    pair = head_pair if drafter == "head" else draft_pair
    ar = LLM(pair["target"], deterministic=True).generate(HEAD_PROMPTS, HEAD_GREEDY)
    llm = LLM(pair["target"], mode="sd", draft=pair["draft"], k=3, deterministic=True)
    drafts = llm.engine.step_strategy.proposer.drafts
    if drafter == "head":
        drafts.graphs = drafts.runner.static_steps(4, 1, capture=False, forward=drafts.step_forward)
        answers = _counting(drafts.graphs)
    else:
        drafts.runner.graphs = drafts.runner.static_steps(4, 4, capture=False)
        answers = _counting(drafts.runner.graphs)
    for batch in ([HEAD_PROMPTS[0]], HEAD_PROMPTS):
        out = llm.generate(batch, HEAD_GREEDY)
        assert [o.token_ids for o in out] == [o.token_ids for o in ar[: len(batch)]]
    assert sum(a is not None for a in answers) > 10
    assert sum(o.metrics["draft_tokens_accepted"] for o in out) > 0
    if drafter == "head":  # a step outside inference mode (as start-up timing runs one) reuses the buffers
        from specfork.speculative.head_runner import HeadState

        st, d = HeadState(), drafts.head.config.hidden_size
        drafts.blocks.grow(st, 5)
        drafts._rows([st], [0], [[1] * 4], torch.zeros(4, d), decode=False, logit_rows=[])
        assert drafts.decode_step([st], [4], [1], torch.zeros(1, d))[0].shape[0] == 1


def test_a_head_step_on_the_static_path_equals_the_ordinary_step(head_pair):
    """One drafting step of the head (hidden states in, outputs and draft logits out) after a
    20-row context, three sequences: the static path (context padded to the key bucket, the
    hidden states copied into their buffer) against the ordinary one."""
    llm = LLM(head_pair["target"], mode="sd", draft=head_pair["draft"], k=3)
    drafts, states, context, tokens, hidden = head_step_inputs(llm)
    want = drafts.decode_step(states, context, tokens, hidden)
    drafts.graphs = drafts.runner.static_steps(4, 1, capture=False, forward=drafts.step_forward)
    answers = _counting(drafts.graphs)
    got = drafts.decode_step(states, context, tokens, hidden)
    assert len(answers) == 1 and answers[0] is not None
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_failed_capture_leaves_every_step_eager(tiny_checkpoints, caplog):
    """If a capture fails (an operation CUDA graphs cannot hold), the step that tried keeps its
    eagerly computed output, a warning says so once, and every later step runs the ordinary
    path: generation goes on with the same tokens."""
    path = str(tiny_checkpoints["llama-gqa-tied"].path)
    ar = _llm(path, static=False, deterministic=True).generate(PROMPTS, GREEDY)
    llm = _llm(path, static=False, deterministic=True)
    runner = llm.engine.runner
    runner.graphs = runner.static_steps(max_seqs=4, max_rows=6, capture=True)

    def refuse(shape):
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    runner.graphs._capture = refuse
    answers = _counting(runner.graphs)
    with caplog.at_level("WARNING", logger="specfork.engine.step_graphs"):
        out = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in out] == [o.token_ids for o in ar]
    assert answers[0] is not None and all(a is None for a in answers[1:]) and len(answers) > 10
    assert [r.message for r in caplog.records] == [
        "CUDA graph capture failed (operation not permitted when stream is capturing); decode steps run eagerly"]
