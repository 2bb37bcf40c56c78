"""``k auto``: the choice follows the cost model, and outputs stay those of AR."""

from __future__ import annotations

import itertools
import random
import re
from collections import Counter

import pytest
from lossless import PROMPT

from specfork import LLM, SamplingParams, SpecforkError
from specfork.config import SSD_DEFAULT_K, Config
from specfork.speculative.auto_k import (
    FIRST_PROBE,
    PROBE_EVERY,
    REPLAN_EVERY,
    AutoK,
    StepCosts,
    modelled_round_s,
    plan,
)
from specfork.speculative.proposer import Proposal, StatelessProposer


def test_plan_maximises_expected_tokens_per_second():
    flat = StepCosts(draft_s=0.001, verify_s=tuple([0.010] * 9))  # verification as cheap as decoding
    assert plan(flat, alpha=0.9)[0].k == 8  # high acceptance, cheap draft: speculate as far as allowed
    assert plan(flat, alpha=0.05)[0].k == 0  # drafts almost never accepted: not worth a draft step
    steep = StepCosts(draft_s=0.002, verify_s=tuple(0.010 * m for m in range(1, 10)))
    assert plan(steep, alpha=0.9)[0].k == 0  # verifying m rows costs m decodes: nothing to gain
    moderate = StepCosts(draft_s=0.001, verify_s=tuple(0.010 + 0.004 * (m - 1) for m in range(1, 10)))
    best = plan(moderate, alpha=0.6)[0]
    rates = {p.k: p.tokens_per_s for p in plan(moderate, alpha=0.6)}
    assert best.tokens_per_s == max(rates.values()) and 0 < best.k < 8
    # E(k) = (1 - a^(k+1)) / (1 - a); T(k) = k * t_draft + t_verify(k + 1)
    two = next(p for p in plan(moderate, alpha=0.5) if p.k == 2)
    assert two.expected_tokens == pytest.approx(1.75) and two.round_s == pytest.approx(2 * 0.001 + 0.018)


def test_observed_acceptance_moves_the_choice():
    costs = StepCosts(draft_s=0.001, verify_s=tuple(0.010 + 0.002 * (m - 1) for m in range(1, 10)))
    auto = AutoK(costs)
    for _ in range(64):  # every proposal rejected at once
        k = auto.ks_for_round()[0]
        auto.observe(max(k, 1), 0)
        auto.end_round([k], modelled_round_s(costs, k))
    assert auto.alpha < 0.1 and auto.current.k == 0
    assert "k=0" in auto.explain() and "without speculation" in auto.explain()
    assert auto.summary().startswith("k=0 (acceptance per token 0.0")
    for _ in range(256):  # now everything is accepted
        k = auto.ks_for_round()[0]
        auto.observe(k, k)
        auto.end_round([k], modelled_round_s(costs, k))
    assert auto.alpha > 0.6 and auto.current.k > 0
    # the one phrase `specfork generate` prints: the choice and its expected gain, not the step costs
    expected, plain = (float(x) for x in re.search(r"(\d+) tok/s expected against (\d+) without", auto.summary()).groups())
    assert auto.summary().startswith(f"k={auto.current.k} ") and expected > plain and "ms" not in auto.summary()


def test_the_summary_prices_the_choice_and_plain_decoding_at_the_same_moment():
    """Plain decoding measured slower after the choice (a shared machine's pace moved) must not
    show up against the choice's older price: `generate` printed "k=0 (... 209 tok/s expected
    against 44 without speculation)"."""
    costs = StepCosts(draft_s=0.001, verify_s=tuple(0.010 + 0.002 * (m - 1) for m in range(1, 10)))
    auto = AutoK(costs)
    before = auto.summary()
    auto._overhead[(1, 0)] = 5.0  # measured since the last choice, which has not been revised yet
    assert auto.summary() == before


def test_plain_decoding_does_not_drift_back_to_speculating_without_evidence():
    """Acceptance 0.2, where speculating loses (it would pay at the fixed prior's 0.5): once k
    auto settles on k = 0, a long stretch of plain decoding must not bring speculation back on
    no new evidence; only the probes (k = 1 every PROBE_EVERY rounds) speculate."""
    costs = StepCosts(draft_s=0.001, verify_s=tuple(0.010 + 0.002 * (m - 1) for m in range(1, 10)))
    auto = AutoK(costs)
    assert plan(costs, 0.5)[0].k > 0 and plan(costs, 0.2)[0].k == 0
    ks, speculating = [], 0
    for _ in range(600):
        k = auto.ks_for_round()[0]
        if k:
            speculating += 1
            auto.observe(k, 1 if speculating % 5 == 0 else 0)  # the first draft accepted 1 time in 5
        auto.end_round([k], modelled_round_s(costs, k))
        ks.append(k)
    late = ks[200:]
    assert auto.current.k == 0 and 0.1 < auto.alpha < 0.3
    assert sum(1 for k in late if k > 0) <= len(late) // PROBE_EVERY + 1, late


def test_measured_round_times_fall_back_to_plain_decoding_when_speculation_does_not_pay():
    """The model (cheap drafts, cheap verification, acceptance 0.5) says speculate; real rounds
    that speculate take 2.2x the model's time while plain rounds take what it says: k auto must
    settle on k = 0 (and keep probing), and return to speculating when the overhead goes away."""
    costs = StepCosts(draft_s=0.001, verify_s=tuple(0.010 + 0.001 * (m - 1) for m in range(1, 10)))
    auto = AutoK(costs)
    assert auto.current.k > 0

    def run(rounds: int, slowdown: float) -> list[int]:
        ks = []
        for _ in range(rounds):
            k = auto.ks_for_round()[0]
            accepted = sum(1 for j in range(k) if j % 2 == 0 and all(i % 2 == 0 for i in range(j)))  # about a = 0.5
            auto.observe(k, min(accepted, 1))
            auto.end_round([k], modelled_round_s(costs, k) * (slowdown if k else 1.0))
            ks.append(k)
        return ks

    ks = run(200, slowdown=2.2)
    assert auto.current.k == 0 and ks[-64:].count(0) >= 60  # plain decoding, probes aside
    assert "measured rounds" in auto.explain()
    run(200, slowdown=1.0)
    assert auto.current.k > 0


def test_positions_a_proposer_leaves_empty_count_as_rejections():
    """A head with a confidence floor proposes nothing in 9 rounds of 10 (each such round costs a
    plain step and two draft steps: catching up, and finding itself unsure); when it proposes,
    its drafts are accepted at a = 0.6. Counted over the proposed positions only, speculation
    looked 1.36x faster than plain decoding (k = 2) where it is ~10% slower: k auto must settle
    on plain decoding. The same head proposing in every round must go on speculating."""
    costs = StepCosts(draft_s=0.0005, verify_s=tuple(0.005 + 0.0006 * (m - 1) for m in range(1, 10)))

    def run(unsure_every: int, count_empty: bool = True) -> tuple[AutoK, list[int]]:
        auto, ks, proposing = AutoK(costs), [], 0
        for i in range(600):
            k = auto.ks_for_round()[0]
            seconds = modelled_round_s(costs, 0)
            if k and i % unsure_every:  # unsure: nothing proposed
                if count_empty:
                    auto.observe(k, 0)
                seconds += 2 * costs.draft_s
            elif k:
                proposing += 1
                auto.observe(k, min(k, proposing % 3))  # 0, 1, 2 accepted in turn: a = 0.6 up to k = 2
                seconds = modelled_round_s(costs, k)
            auto.end_round([k], seconds)
            ks.append(k)
        return auto, ks

    assert plan(costs, alpha=0.6)[0].k > 0
    unsure, ks = run(unsure_every=10)
    assert unsure.current.k == 0 and ks[-128:].count(0) >= 124, ks[-128:]
    sure, ks = run(unsure_every=1)
    assert sure.current.k > 0 and ks[-128:].count(0) <= 4
    proposed_only, ks = run(unsure_every=10, count_empty=False)  # SD's old count: empty rounds unheard
    assert proposed_only.current.k > 0 and ks[-128:].count(0) <= 4


class EveryThirdRound(StatelessProposer):
    """Proposes each sequence's AR continuation in one round of three, nothing in the others."""

    def __init__(self, continuation: list[int]) -> None:
        self.continuation = continuation
        self.rounds = 0

    def propose(self, seqs, num_tokens):
        self.rounds += 1
        done = seqs[0].num_output_tokens
        return Proposal([self.continuation[done : done + n] if self.rounds % 3 == 0 else [] for n in num_tokens], None)


def test_sd_tells_k_auto_the_positions_it_asked_for(draft_pair):
    """k auto learns from every position a round asked the proposer for, including those it left
    empty (SD passed the proposed count, so rounds without proposals told it nothing)."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ar = LLM(draft_pair["target"], deterministic=True).generate([PROMPT], params)[0].token_ids
    llm = LLM(draft_pair["target"], mode="sd", drafter="ngram", deterministic=True)
    auto = llm.engine.step_strategy.auto_k
    auto.ks_for_round = lambda batch=1: [4] * batch
    seen = []
    auto.observe = lambda asked, accepted: seen.append((asked, accepted))
    llm.engine.step_strategy.proposer = EveryThirdRound(ar)
    assert llm.generate([PROMPT], params)[0].token_ids == ar
    assert (4, 0) in seen and (4, 4) in seen  # a round left empty, and a round proposed and accepted in full
    assert seen.count((4, 0)) > seen.count((4, 4)) and all(asked == 4 for asked, _ in seen[:4])
    assert [asked for asked, _ in seen if asked < 4] == [1, 0]  # the budget near max_tokens, not k


def test_forward_time_is_interpolated_between_measured_windows_and_extended_past_them():
    costs = StepCosts(draft_s=0.002, verify_s=tuple(0.010 + 0.001 * (m - 1) for m in range(1, 10)),
                      long_s=((16, 0.030), (32, 0.070)))
    assert costs.forward_s(9) == pytest.approx(0.018)
    assert costs.forward_s(12) == pytest.approx(0.018 + 0.012 * 3 / 7)  # between 9 and 16 rows
    assert costs.forward_s(24) == pytest.approx(0.050)  # between 16 and 32
    assert costs.forward_s(64) == pytest.approx(0.070 + 0.0025 * 32)  # the last slope, past 32
    assert costs.draft_step_s(1) == 0.002 and costs.draft_step_s(8) == pytest.approx(0.002 * 0.017 / 0.010)
    assert StepCosts(0.0, (0.01, 0.02)).forward_s(5) == pytest.approx(0.05)  # no longer windows: the last slope


# One sequence verifies 2..9 rows for little more than one (memory-bound), but past 8 rows the
# forward grows with its rows (compute-bound): what a 2-core CPU measures.
CPU_LIKE = StepCosts(draft_s=0.0002, verify_s=(0.0050, 0.0052, 0.0055, 0.0058, 0.0062, 0.0066, 0.0070, 0.0074, 0.0080),
                     long_s=((16, 0.0140), (32, 0.0280), (64, 0.0560)))


def test_a_round_is_priced_by_the_rows_of_its_whole_batch():
    """At batch 1, k = 4 costs 1.24x a plain step; at batch 8 the batch's 40 rows cost 4.5x its
    8: speculation pays at batch 1 and not at batch 8 (priced per sequence, it did at both)."""
    assert modelled_round_s(CPU_LIKE, 4, batch=8) == pytest.approx(4 * 0.0002 * 0.0074 / 0.0050 + 0.0280 + 0.0280 / 4)
    alone, batched = plan(CPU_LIKE, alpha=0.6)[0], plan(CPU_LIKE, alpha=0.6, batch=8)[0]
    assert alone.k > 0 and batched.k == 0
    assert batched.tokens_per_s == pytest.approx(8 / 0.0074)  # the batch's rate
    auto = AutoK(CPU_LIKE)
    for accepted in [1, 1, 1, 0, 0] * 20:  # a = 0.6 with plenty of evidence
        auto.observe(1, accepted)
    assert auto.alpha == pytest.approx(0.6, abs=0.01)
    assert max(auto.ks_for_round(8)) == 0 and "k=0 at batch 8" in auto.explain()
    assert max(auto.ks_for_round(1)) > 0


def test_a_probe_in_a_batch_speculates_for_one_sequence_in_turn():
    auto = AutoK(CPU_LIKE)
    for accepted in ([1] + [0] * 9) * 3:  # a = 0.1: plain decoding at any batch size
        auto.observe(1, accepted)
    probes = []
    for _ in range(3 * PROBE_EVERY):
        ks = auto.ks_for_round(4)
        if any(ks):
            probes.append(ks)
            auto.observe(1, 0)
        auto.end_round(ks, modelled_round_s(CPU_LIKE, max(ks), 4))
    assert len(probes) == 3 and all(sorted(ks) == [0, 0, 0, 1] for ks in probes)
    assert len({ks.index(1) for ks in probes}) == 3  # a different sequence each time
    assert (4, 1) not in auto._overhead  # a mixed round prices no single k
    assert auto.rounds == 3 * PROBE_EVERY and FIRST_PROBE < PROBE_EVERY


def test_measured_overhead_is_kept_per_batch_size():
    """Rounds at batch 8 that speculate turn out 3x slower than modelled; that must stop
    speculation at batch 8 without stopping it at batch 1, where the model holds."""
    costs = StepCosts(draft_s=0.0002, verify_s=tuple(0.005 + 0.0001 * (m - 1) for m in range(1, 10)),
                      long_s=((16, 0.0060), (32, 0.0070), (64, 0.0090)))  # a GPU-like flat forward
    auto = AutoK(costs)
    for _ in range(200):
        for batch, slowdown in ((8, 3.0), (1, 1.0)):
            ks = auto.ks_for_round(batch)
            k = max(ks)
            auto.observe(k, k // 2)
            auto.end_round(ks, modelled_round_s(costs, k, batch) * (slowdown if k and min(ks) else 1.0))
    assert auto.overhead(1, 8) > 2 and auto.overhead(1, 1) == pytest.approx(1.0)
    assert max(auto.ks_for_round(8)) == 0 or auto.rounds % PROBE_EVERY == FIRST_PROBE
    assert max(auto.ks_for_round(1)) > 0


def test_a_slow_stretch_of_plain_rounds_does_not_hold_k_auto_at_speculating():
    """At batch 8 plain decoding beats k = 1 by ~7%. A stretch of rounds at twice their time hits
    while decoding plainly, so k = 0's measured overhead doubles and k auto turns to k = 1; then
    the machine is back to its pace. The next k = 0 probe must bring it back: an average over
    samples kept the stale measurement for several probes (over 90 rounds at k = 1)."""
    auto = AutoK(CPU_LIKE)
    pattern = [1, 1, 1, 1, 0]  # a = 0.8

    def rounds(n: int, slowdown: float, until_speculating: bool = False) -> list[int]:
        ks = []
        for i in range(n):
            if until_speculating and auto.current.k > 0:
                break
            round_ks = auto.ks_for_round(8)
            k = max(round_ks)
            for proposed in round_ks:
                if proposed:
                    auto.observe(proposed, min(proposed, pattern[i % 5]))
            auto.end_round(round_ks, modelled_round_s(CPU_LIKE, max(round_ks), 8) * slowdown)
            ks.append(k)
        return ks

    for accepted in pattern * 20:
        auto.observe(1, accepted)
    rounds(32, slowdown=1.0)
    assert auto.current.k == 0 and 0.75 < auto.alpha < 0.85
    rounds(32, slowdown=2.0, until_speculating=True)  # the machine is busy elsewhere while k = 0 runs
    assert auto.current.k > 0  # plain rounds looked twice as slow as modelled
    after = rounds(48, slowdown=1.0)
    assert auto.current.k == 0 and after[-8:].count(0) >= 7, after


def test_plain_rounds_in_one_call_leave_k_auto_as_rounds_one_at_a_time_leave_it():
    """SD runs several plain rounds in one call where k auto allows (``plain_rounds``): never past
    the next probe or re-plan, so the rounds' choices, the probes and what k auto learns are those
    of one round at a time; while speculating a plain probe runs as many rounds as a call at k =
    0 would, so that it prices plain decoding as it runs."""
    steep = StepCosts(draft_s=0.002, verify_s=tuple(0.010 * m for m in range(1, 10)))  # plain decoding wins

    def run(batched: bool) -> tuple[list[int], AutoK, list[int]]:
        auto, ks_per_round, calls = AutoK(steep), [], []
        while len(ks_per_round) < 200:
            ks = auto.ks_for_round()
            n = auto.plain_rounds() if batched and not any(ks) else 1
            if any(ks):
                auto.observe(ks[0], 0)
            auto.end_round(ks, n * modelled_round_s(steep, max(ks)), rounds=n)
            ks_per_round += ks * n
            calls.append(n)
        return ks_per_round, auto, calls

    single, one_at_a_time, _ = run(False)
    batched, several, calls = run(True)
    assert batched == single and 1 in single  # the same probes, at the same tokens
    assert several.rounds == one_at_a_time.rounds and several.rounds_by_k == one_at_a_time.rounds_by_k
    assert several.current == one_at_a_time.current and several.alpha == pytest.approx(one_at_a_time.alpha)
    assert several.overhead(0) == pytest.approx(one_at_a_time.overhead(0))
    assert max(calls) == 8 and len(calls) < 60  # calls of up to a re-plan's 8 rounds
    speculating = AutoK(StepCosts(draft_s=0.0001, verify_s=tuple([0.010] * 9)))
    assert speculating.current.k > 0 and speculating.plain_rounds() == REPLAN_EVERY


def test_a_plain_probe_while_speculating_runs_as_plain_decoding_would_and_keeps_the_cadence():
    """Speculating, k auto's plain probe runs several plain rounds in one call (a caller taking up
    to 6), priced at their per-round time, never past a re-plan: the probes still come every
    PROBE_EVERY rounds, alternating with k + 1; and a call that was one slow moment is one stall,
    set aside as a whole (its equal shares would have agreed with each other)."""
    cheap = StepCosts(draft_s=0.0001, verify_s=tuple(0.010 + 0.002 * m for m in range(9)))
    auto, calls = AutoK(cheap), []

    def call(slowdown: float = 1.0) -> tuple[int, int, int]:
        ks = auto.ks_for_round()
        start, since_plan = auto.rounds, auto._since_plan
        n = min(6, auto.plain_rounds()) if not any(ks) else 1
        assert since_plan + n <= REPLAN_EVERY  # a call never runs past a re-plan
        if any(ks):
            auto.observe(ks[0], min(ks[0], 2))  # runs of 2: k auto speculates below its maximum
        plain_pace = 0.9 if not any(ks) else 1.0
        auto.end_round(ks, n * modelled_round_s(cheap, max(ks)) * plain_pace * slowdown, rounds=n)
        return start, max(ks), n

    while auto.rounds < 8 * PROBE_EVERY:
        calls.append(call())
    assert 0 < auto.current.k < auto.k_max
    probes = [(k, n) for start, k, n in calls if start % PROBE_EVERY == FIRST_PROBE]
    plain = [n for k, n in probes if k == 0]
    assert len(plain) >= 3 and len(probes) - len(plain) >= 3  # alternating with k + 1, every PROBE_EVERY rounds
    assert all(n > 1 for n in plain)  # priced as plain decoding runs: several steps a call
    assert auto.rounds_by_k["k=0"] == sum(plain)
    assert auto.overhead(0) == pytest.approx(0.9)  # per round, not per call
    # a plain probe 10x slower than modelled, once: set aside whole, k = 0's price unchanged
    before = auto.overhead(0)
    for _ in range(2 * PROBE_EVERY):
        start, k, n = call(slowdown=10.0 if auto.rounds % PROBE_EVERY == FIRST_PROBE - 1 else 1.0)
        if k == 0:
            break
    assert k == 0 and n > 1 and auto.overhead(0) == before


def test_probes_of_a_longer_window_correct_step_costs_measured_too_high():
    """The start-up measurement priced windows of 3 or more rows 1.6x too high (a noisy moment),
    so k auto starts at k = 1, and every k it does not run borrows k = 1's correction. Real rounds
    take the true times, with acceptance 0.8, where k = 4 or more pays best: the probes of k + 1
    must walk k up to it."""
    true = StepCosts(draft_s=0.0002, verify_s=tuple(0.005 + 0.0004 * (m - 1) for m in range(1, 10)))
    measured = StepCosts(draft_s=0.0002, verify_s=tuple(t * (1.6 if m >= 3 else 1.0)
                                                        for m, t in enumerate(true.verify_s, start=1)))
    best = plan(true, alpha=0.8)[0].k
    assert best >= 4 and plan(measured, alpha=0.8)[0].k == 1
    auto = AutoK(measured)
    for accepted in [1, 1, 1, 1, 0] * 10:  # a = 0.8 already known
        auto.observe(1, accepted)
    assert auto.current.k == 1
    pattern = [1, 1, 1, 1, 0] * 2  # runs of 4 accepted, then a rejection
    ks = []
    for i in range(40 * PROBE_EVERY):
        k = auto.ks_for_round()[0]
        if k:
            auto.observe(k, min(k, sum(1 for _ in itertools.takewhile(bool, pattern[i % 5 :]))))
        auto.end_round([k], modelled_round_s(true, k))
        ks.append(k)
    late = ks[-4 * PROBE_EVERY :]
    assert auto.current.k >= best - 1 and min(late) == 0 and max(late) > 1, late  # probes of 0 and of k + 1 go on
    assert {k for k in late if k != auto.current.k} <= {0, auto.current.k + 1}


def test_k_auto_sd_equals_ar(tiny_checkpoints):
    path = str(tiny_checkpoints["llama-gqa-tied"].path)
    prompts = [[1, 5, 9, 5, 9, 5, 9, 5], [1, 2, 3, 4, 2, 3, 4, 2, 3]]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ar = [o.token_ids for o in LLM(path, deterministic=True).generate(prompts, params)]
    for drafter, draft in (("ngram", None), ("draft", str(tiny_checkpoints["llama3-rope-untied-sharded"].path))):
        llm = LLM(path, mode="sd", drafter=drafter, draft=draft, deterministic=True)  # k auto: SD's default
        free = llm.engine.block_manager.num_free_blocks  # the measurements at start-up gave back their blocks
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == ar
        for m in (o.metrics for o in outs):  # plain rounds are rounds, each emitting one token
            with_drafts = m["spec_rounds"] - m["spec_rounds_without_drafts"]
            assert with_drafts <= m["draft_tokens_proposed"] <= 8 * with_drafts
            assert m["spec_tokens_emitted"] == m["draft_tokens_accepted"] + m["spec_rounds"] == 39
        auto = llm.engine.step_strategy.auto_k
        assert len(auto.costs.verify_s) == 9 and all(t > 0 for t in auto.costs.verify_s)
        assert [m for m, _ in auto.costs.long_s] == [16, 32, 64] and all(t > 0 for _, t in auto.costs.long_s)
        assert (auto.costs.draft_s == 0) == (drafter == "ngram")
        assert llm.engine.block_manager.num_free_blocks == free == llm.engine.block_manager.num_blocks


def test_k_auto_measures_its_drafter_within_a_small_kv_cache(tiny_checkpoints, head_pair):
    """k auto times one draft step at start-up after a 64-token context; a cache of 3 blocks (48
    tokens) used to fail there with "KV cache exhausted" (a traceback from `specfork generate`)."""
    prompts = [[1, 5, 3, 5, 3, 5, 3, 5]]  # ids inside the head pair's 8-token vocabulary
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    models = ((str(tiny_checkpoints["llama-gqa-tied"].path), str(tiny_checkpoints["llama3-rope-untied-sharded"].path)),
              (str(head_pair["target"]), str(head_pair["draft"])))
    for target, draft in models:
        ar = [o.token_ids for o in LLM(target, deterministic=True).generate(prompts, params)]
        llm = LLM(target, mode="sd", draft=draft, deterministic=True, num_kv_blocks=3)
        assert llm.engine.step_strategy.auto_k.costs.draft_s > 0
        assert [o.token_ids for o in llm.generate(prompts, params)] == ar


def test_sd_defaults_to_k_auto_and_ssd_to_a_fixed_k():
    assert Config(mode="sd").k == "auto" and Config(mode="sd", drafter="ngram").k == "auto"
    assert Config(mode="ssd").k == SSD_DEFAULT_K == 5
    assert Config(mode="sd", k=3).k == 3 and Config(mode="ssd", k=2).k == 2


def test_k_auto_is_refused_for_ssd_and_bad_k_values():
    with pytest.raises(SpecforkError, match="k 'auto' is for SD"):
        LLM(mode="ssd", k="auto")
    with pytest.raises(SpecforkError, match="k must be"):
        LLM(mode="sd", k="many")


@pytest.mark.parametrize("max_model_len", [None, 16])
def test_k_auto_measures_within_a_short_models_positions(draft_pair, max_model_len):
    """The start-up measurement's context (64 tokens and up to 9 rows) is cut to the positions the
    target and the draft were built for (a model of 64, or a shorter --max-model-len); it failed
    the engine's construction with an IndexError."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    sd = LLM(draft_pair["target"], mode="sd", draft=draft_pair["draft"], k="auto", deterministic=True,
             max_model_len=max_model_len)
    assert sd.engine.max_model_len == (max_model_len or 64)
    assert sd.generate([PROMPT], params)[0].token_ids == LLM(draft_pair["target"], deterministic=True).generate(
        [PROMPT], params)[0].token_ids


H200 = StepCosts(draft_s=0.00029, verify_s=(0.0027, 0.0037, 0.0045, 0.0041, 0.0042, 0.0044, 0.0045, 0.0045, 0.0045))


def test_a_one_off_stall_prices_no_k_and_a_lasting_slowdown_is_believed_from_its_second_round():
    auto = AutoK(H200)

    def round_of(k: int, slowdown: float) -> None:
        auto.ks_for_round()
        auto.end_round([k], modelled_round_s(H200, k) * slowdown)

    round_of(3, 12.0)  # a CUDA graph captured in this round
    assert auto.overhead(3) == 1.0
    round_of(3, 1.1)
    assert auto.overhead(3) == pytest.approx(1.1)
    round_of(3, 4.4)  # the machine got 4x slower and stays so
    assert auto.overhead(3) == pytest.approx(1.1)
    round_of(3, 4.4)
    assert auto.overhead(3) == pytest.approx(0.7**2 * 1.1 + (1 - 0.7**2) * 4.4)  # two rounds since the last
    round_of(4, 4.4)  # k = 4 has no rounds of its own: within 3x of k = 3's overhead, believed at once
    assert auto.overhead(4) == pytest.approx(4.4)
    round_of(0, 12.0)  # a plain round's stall
    assert auto.overhead(0) == 1.0


def test_graph_captures_on_first_use_do_not_drive_k_auto_off_the_best_k():
    """Step costs as measured on an H200, rounds 1.05x the model's, acceptance 0.6 per token
    (k = 3 pays best). As on a GPU, the first round of each window length pays ~50 ms for its
    CUDA graph, and again at every new key bucket (here every 300 rounds). Weighted like the
    others, those rounds priced the k they hit at up to 12x, and k auto spent most rounds at
    k = 0, 1 or 2 (it ended this run at k = 1); it must settle on k = 3."""
    assert plan(H200, 0.6)[0].k == 3
    rng = random.Random(0)
    auto, captured, ks = AutoK(H200), set(), []
    for i in range(2000):
        if i % 300 == 0:
            captured.clear()
        k = auto.ks_for_round()[0]
        if k:
            auto.observe(k, sum(1 for _ in itertools.takewhile(lambda _: rng.random() < 0.6, range(k))))
        auto.end_round([k], modelled_round_s(H200, k) * 1.05 + (0.05 if k not in captured else 0.0))
        captured.add(k)
        ks.append(k)
    assert auto.current.k == 3 and ks.count(3) > 0.8 * len(ks), Counter(ks)
