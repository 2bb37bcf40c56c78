"""Scaling out over torch.distributed (gloo, 2-3 processes on this CPU): tensor parallelism and
SSD's drafter as a rank.

TP = 2 must compute what TP = 1 computes (up to the order of the all-reduced sums: stated
tolerances), keep speculative decoding exact (greedy SD/SSD = AR on the same TP layout, bit for
bit in deterministic mode; the chi-square test at temperature), and end cleanly when a rank
dies or hangs: a clear error, no process left behind. SSD with its drafter as a rank gives AR's
tokens, before and after the drafter rank is killed."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import time

import pytest
import torch
from helpers import assert_greedy_match, max_abs_diff, prefill_logits
from lossless import NUM_TOKENS, PROMPT, SETTINGS, check, exact_joint, sample_ssd, sampling_params

from specfork import LLM, SamplingParams
from specfork.errors import EngineFailure, ModelLoadError, SpecforkError
from specfork.models.config import ModelArchConfig
from specfork.models.tensor_parallel import TensorShard

pytestmark = pytest.mark.dist

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _logits_and_greedy(llm, prompt, n):
    """Prefill logits of ``prompt`` and the greedy continuation's tokens with their logits."""
    prefill = prefill_logits(llm, prompt)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0].token_ids
    along = prefill_logits(llm, prompt + out[:-1])[len(prompt) - 1:]  # the rows each token was picked from
    return prefill, out, along


def _compare(tp1, tp2, prompt, n, rel_tol):
    ref, ref_out, ref_along = _logits_and_greedy(tp1, prompt, n)
    got, got_out, _ = _logits_and_greedy(tp2, prompt, n)
    diff, scale = max_abs_diff(got, ref), float(ref.abs().max())
    assert diff <= rel_tol * scale, f"TP=2 logits differ from TP=1 by {diff:.3e} (max |logit| {scale:.1f})"
    assert_greedy_match(got_out, ref_out, ref_along, atol=rel_tol * scale, rtol=0.0, label="TP=2 vs TP=1")
    return diff / scale


def test_tp2_logits_equal_tp1_on_every_tiny_family(tiny_checkpoint):
    """Llama (GQA, tied), Llama 3 with one KV head (replicated on both ranks), Qwen2 (q/k/v
    biases split, untied head), Qwen3 (q/k norms). Float32: the sums differ in rounding only."""
    prompt = [1, 5, 9, 13, 2, 7, 30, 31, 40, 41, 42]
    with LLM(str(tiny_checkpoint.path)) as tp1, LLM(str(tiny_checkpoint.path), tensor_parallel_size=2) as tp2:
        assert tp2.engine.runner.model.config.num_heads < tp1.engine.runner.model.config.num_heads
        _compare(tp1, tp2, prompt, 32, rel_tol=1e-5)


def test_tp2_on_the_embedded_model():
    """The GGUF's Q4_1 blocks split along their groups (SmolLM2: 9 query / 3 KV heads become 6/2 + 3/1).
    o's and down's sums over their inputs are split in two and added in another order, which moves
    logits by about 1e-4 of their range (measured 4.4e-3 at max |logit| 30): tolerance 1e-3 of it."""
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3717, 282, 1456, 30, 2, 198]
    with LLM(threads=1) as tp1, LLM(tensor_parallel_size=2, threads=1) as tp2:
        heads = [tp2.engine.runner.model.config.num_heads, tp2.engine.runner.model.config.num_kv_heads]
        assert heads == [6, 2]
        rel = _compare(tp1, tp2, prompt, 48, rel_tol=1e-3)
        assert rel > 0, "the two layouts cannot agree bit for bit: is the second one really split?"


def test_shards_cover_every_head_and_unit_once():
    arch = ModelArchConfig("llama", 100, 576, 1536, 2, 9, 3, 64, 1e-5, 1e4, 64, True)
    for size in (1, 2, 3):
        shards = [TensorShard(r, size, lambda t: t) for r in range(size)]
        q = [h for s in shards for h in s.heads(arch)[0]]
        kv = [h for s in shards for h in s.heads(arch)[1]]
        units = [u for s in shards for u in s.units(arch)]
        assert q == list(range(9)) and kv == list(range(3)) and units == list(range(1536))
        assert all(len(s.units(arch)) % 128 == 0 for s in shards)  # GGUF blocks (32) never cut
    mqa = ModelArchConfig("llama", 100, 64, 128, 2, 4, 1, 16, 1e-5, 1e4, 64, True)
    assert [TensorShard(r, 2, None).heads(mqa) for r in range(2)] == [(range(0, 2), range(0, 1)),
                                                                       (range(2, 4), range(0, 1))]
    with pytest.raises(ModelLoadError, match="cannot split 4 query / 1 KV heads over 3"):
        TensorShard(0, 3, None).heads(mqa)


def test_tp2_speculative_decoding_equals_tp2_ar(head_pair, draft_pair):
    """Deterministic mode, batch 1 and 4: SD with a draft model, SD with an EAGLE-3 head (its
    features come from rank 0's residual stream, complete after each all-reduce), SSD with the
    head, and SSD with a draft model on a third rank all give TP = 2 AR's tokens. At fixed k the drafts
    are accepted; k auto measures its costs over both ranks and may then choose plain decoding."""
    prompts = [PROMPT, [2, 4], [6, 1, 1, 0, 3], [5]]
    target = head_pair["target"]
    assert draft_pair["target"].endswith("target")  # the same tiny target (seed 11) in both pairs
    with LLM(target, tensor_parallel_size=2, deterministic=True) as ar:
        expected = [o.token_ids for o in ar.generate(prompts, GREEDY)]
    modes = [dict(mode="sd", draft=draft_pair["draft"], k=3), dict(mode="sd", draft=head_pair["draft"], k=4),
             dict(mode="sd", draft=head_pair["draft"]),  # k auto, SD's default: measured over both ranks
             dict(mode="ssd", draft=head_pair["draft"], k=3, backup="fast"),
             dict(mode="ssd", draft=draft_pair["draft"], k=3, drafter_rank=2)]  # a world of 3 ranks
    for options in modes:
        with LLM(target, tensor_parallel_size=2, deterministic=True, **options) as llm:
            for batch in ([prompts[0]], prompts):
                outs = llm.generate(batch, GREEDY)
                assert [o.token_ids for o in outs] == expected[: len(batch)], options
            if "k" in options:
                assert sum(o.metrics["draft_tokens_accepted"] for o in outs) > 0, options
            else:  # k auto may choose plain decoding: on this tiny target a draft step costs what a target step does
                costs = llm.engine.step_strategy.auto_k.costs
                assert len(costs.verify_s) == 9 and all(t > 0 for t in costs.verify_s), costs
            assert llm.health().degraded is None, options


def test_tp2_speculative_sampling_is_lossless(draft_pair):
    """SD with TP = 2 at temperature 1: the chi-square test of the lossless suite."""
    params_kw, n = SETTINGS["temperature"], 6000
    joint = exact_joint(draft_pair["hf_target"], SamplingParams(**params_kw), NUM_TOKENS)
    with LLM(draft_pair["target"], mode="sd", draft=draft_pair["draft"], k=3, max_num_seqs=512,
             kv_cache_tokens=512 * 16, tensor_parallel_size=2) as llm:
        params = [sampling_params(i, params_kw) for i in range(n)]
        outs = llm.generate([PROMPT] * n, params)
    accepted = sum(o.metrics["draft_tokens_accepted"] for o in outs)
    assert 0 < accepted < sum(o.metrics["draft_tokens_proposed"] for o in outs)
    for name, (stat, dof, limit) in check([tuple(o.token_ids) for o in outs], joint).items():
        assert stat < limit, f"{name}: chi2 {stat:.1f} >= {limit:.1f} (dof {dof})"


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["temperature", "top-p"])
def test_tp2_ssd_with_the_drafter_as_a_rank_is_lossless(draft_pair, setting):
    """SSD with TP = 2 and its drafter as a third rank: the chi-square test, with cache hits and
    misses, acceptances and rejections (checked by ``sample_ssd``)."""
    params_kw = SETTINGS[setting]
    joint = exact_joint(draft_pair["hf_target"], SamplingParams(**params_kw), NUM_TOKENS)
    samples = sample_ssd(draft_pair, params_kw, "jit", None, 6000, tensor_parallel_size=2, drafter_rank=2)
    for name, (stat, dof, limit) in check(samples, joint).items():
        assert stat < limit, f"{setting} {name}: chi2 {stat:.1f} >= {limit:.1f} (dof {dof})"


def _gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_a_killed_rank_ends_the_run_with_a_clear_error(draft_pair):
    llm = LLM(draft_pair["target"], tensor_parallel_size=2)
    worker = llm.engine.parallel.workers[0]
    assert len(llm.generate([PROMPT], GREEDY)[0].token_ids) == GREEDY.max_tokens
    os.kill(worker.pid, signal.SIGKILL)
    for _ in range(2):  # the failure is remembered: no second attempt hangs
        with pytest.raises(EngineFailure, match=rf"tensor-parallel rank 1 \(pid {worker.pid}\) exited with code -9"):
            llm.generate([PROMPT], GREEDY)
    llm.close()
    assert _gone(worker.pid)


def test_a_hung_rank_ends_the_run_after_the_timeout(draft_pair):
    llm = LLM(draft_pair["target"], tensor_parallel_size=2, dist_timeout_s=2)
    worker = llm.engine.parallel.workers[0]
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(EngineFailure, match="did not answer within 2 s"):
            llm.generate([PROMPT], GREEDY)
        assert time.monotonic() - started < 30
    finally:
        llm.close()
    assert _gone(worker.pid)


def test_ranks_wait_out_an_idle_engine(draft_pair):
    """An engine idle for longer than --dist-timeout (a server between requests) keeps its
    shards and its drafter rank: the timeout bounds waits on a rank at work, not idle ones."""
    with LLM(draft_pair["target"], tensor_parallel_size=2, mode="ssd", draft=draft_pair["draft"], k=2,
             drafter_rank=2, dist_timeout_s=1, deterministic=True) as llm:
        first = llm.generate([PROMPT], GREEDY)[0].token_ids
        time.sleep(2.5)
        assert llm.generate([PROMPT], GREEDY)[0].token_ids == first
        assert llm.health().degraded is None


def test_ranks_leave_with_the_engine(draft_pair):
    with LLM(draft_pair["target"], tensor_parallel_size=2) as llm:
        pids = [w.pid for w in llm.engine.parallel.workers]
        llm.generate([PROMPT], GREEDY)
    assert all(_gone(pid) for pid in pids)


def test_a_split_that_cannot_be_is_refused_before_any_rank_starts(monkeypatch, draft_pair):
    """Checked from the config before launching (it was found by the ranks, ~25 s later for the
    embedded model at --tensor-parallel-size 10)."""
    from specfork.parallel.world import World

    def no_launch(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(World, "start", no_launch)
    with pytest.raises(ModelLoadError, match="cannot split 2 query / 1 KV heads over 3"):
        LLM(draft_pair["target"], tensor_parallel_size=3)


def test_a_rank_that_cannot_load_is_reported(monkeypatch, draft_pair):
    """A rank whose load fails: the error names the cause, and the group is torn down (this
    process can start another). The pre-launch check is told the heads split, so the ranks find
    out themselves."""
    import specfork.loading.loader as loader

    arch = loader.read_arch(draft_pair["target"])
    monkeypatch.setattr(loader, "read_arch", lambda model: dataclasses.replace(arch, num_heads=3, num_kv_heads=3))
    with pytest.raises(ModelLoadError, match="cannot split 2 query / 1 KV heads over 3"):
        LLM(draft_pair["target"], tensor_parallel_size=3)
    assert torch.distributed.is_initialized() is False


def test_ssd_with_the_drafter_as_a_rank_equals_ar_and_survives_its_death(draft_pair):
    prompts = [PROMPT, [2, 4], [6, 1, 1, 0, 3], [5]]
    with LLM(draft_pair["target"], deterministic=True) as ar:
        expected = [o.token_ids for o in ar.generate(prompts, GREEDY)]
    with LLM(draft_pair["target"], mode="ssd", draft=draft_pair["draft"], k=3, drafter_rank=1,
             deterministic=True) as llm:
        proposer = llm.engine.step_strategy.proposer
        drafter = proposer.process
        assert drafter is not None and llm.engine.world.size == 2
        outs = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == expected
        assert sum(o.metrics["ssd_cache_hits"] for o in outs) > 0
        os.kill(drafter.pid, signal.SIGKILL)
        after = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in after] == expected
        health = llm.health()
        assert health.drafter_failures == 1 and "a drafter rank is not restarted" in health.degraded
        assert proposer.drafter is None and llm.generate(prompts[:1], GREEDY)[0].token_ids == expected[0]
    assert _gone(drafter.pid)


@pytest.mark.slow
def test_a_hung_drafter_rank_is_cut_off_within_seconds(draft_pair):
    """SIGSTOP: the round waits out --drafter-timeout, the rank is killed within a few seconds
    more, and the run goes on in-process with AR's tokens."""
    with LLM(draft_pair["target"], deterministic=True) as ar:
        expected = ar.generate([PROMPT], GREEDY)[0].token_ids
    with LLM(draft_pair["target"], mode="ssd", draft=draft_pair["draft"], k=3, drafter_rank=1, deterministic=True,
             drafter_timeout_s=2) as llm:
        drafter = llm.engine.step_strategy.proposer.process
        assert llm.generate([PROMPT], GREEDY)[0].token_ids == expected
        os.kill(drafter.pid, signal.SIGSTOP)
        started = time.monotonic()
        assert llm.generate([PROMPT], GREEDY)[0].token_ids == expected
        assert time.monotonic() - started < 15
        # stopped with a receive posted, the request goes and its reply is late; stopped between two
        # receives, the request itself is not taken: either way the round's 2 s bound it
        assert re.search(r"did not (answer|take a request) within 2\.0 s", llm.health().degraded)
    assert _gone(drafter.pid)


def test_a_request_to_a_drafter_rank_waits_for_its_send_no_longer_than_the_round():
    """A rank takes a message only while its receiver thread has a receive posted; one stopped
    between two receives (a hung rank, caught once in CI) held the round for the world's timeout
    (--dist-timeout, minutes) where --drafter-timeout allows seconds: the send now gets the
    round's timeout too."""
    from specfork.parallel import connection
    from specfork.speculative.ssd.transport import DrafterError, DrafterRank

    class StuckConnection:
        closed = False

        def send(self, message, timeout_s=None):
            self.timeout_s = timeout_s
            raise connection.SendTimeout(f"rank 1 did not take a message within {timeout_s:.1f} s")

    rank = object.__new__(DrafterRank)  # its transport alone: no world
    rank.conn, rank.process, rank.rank = StuckConnection(), None, 1
    with pytest.raises(DrafterError, match="did not take a request within 2.0 s"):
        rank.request(("spec", [], []), 2.0)
    assert rank.conn.timeout_s == 2.0


def test_a_rank_connection_tells_a_send_that_timed_out_from_a_peer_that_is_gone(monkeypatch):
    """gloo's errors, as a send's wait raises them: a timeout (the peer may only be hung) and a
    closed connection (it is gone), both ConnectionResetErrors for whoever ends on a lost peer."""
    from specfork.parallel import connection

    conn = object.__new__(connection.RankConnection)  # its send alone: no world
    conn.peer, conn._group, conn.closed = 1, None, False
    for text, expected, message in [
        ("[gloo/transport/tcp/unbound_buffer.cc:133] Timed out waiting 2000ms for send operation to complete",
         connection.SendTimeout, "rank 1 did not take a message within 2.0 s"),
        ("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234",
         ConnectionResetError, r"rank 1 is gone \(connection closed\)")]:
        def failing(*args, text=text):
            raise RuntimeError(text)

        monkeypatch.setattr(connection, "send_frame", failing)
        with pytest.raises(ConnectionResetError, match=message) as caught:
            conn.send(("spec", [], []), timeout_s=2.0)
        assert type(caught.value) is expected


def test_drafter_rank_settings_are_checked(draft_pair):
    with pytest.raises(SpecforkError, match="needs mode 'ssd'"):
        LLM(draft_pair["target"], drafter_rank=1)
    with pytest.raises(SpecforkError, match="drafter_rank must be 2"):
        LLM(draft_pair["target"], mode="ssd", tensor_parallel_size=2, drafter_rank=1)


def test_a_torchrun_group_runs_the_shards_and_the_drafter_rank(tmp_path, draft_pair):
    """`torchrun --nproc-per-node 3 -m specfork generate ... --distributed-launch torchrun`:
    ranks 0-1 hold the shards, rank 2 is SSD's drafter; every process exits cleanly, and the
    tokens are those of TP = 2 AR started locally."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    prompts = [PROMPT, [2, 4, 6, 1]]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"token_ids": p}) + "\n" for p in prompts))
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--nproc-per-node", "3", "-m", "specfork", "generate", "--model", draft_pair["target"],
               "--tensor-parallel-size", "2", "--distributed-launch", "torchrun", "--mode", "ssd", "--draft",
               draft_pair["draft"], "--drafter-rank", "2", "--k", "3", "--deterministic", "--temperature", "0",
               "--max-tokens", str(GREEDY.max_tokens), "--ignore-eos", "--prompts-file", str(tmp_path / "prompts.jsonl"),
               "--output", str(tmp_path / "out.jsonl"), "--no-progress"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = [json.loads(line)["token_ids"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    with LLM(draft_pair["target"], tensor_parallel_size=2, deterministic=True) as ar:
        assert got == [o.token_ids for o in ar.generate(prompts, GREEDY)]


def test_ranks_do_not_outlive_a_killed_engine(draft_pair):
    """SIGKILL on rank 0 (nothing runs its clean-up): the ranks it started end by themselves."""
    import subprocess
    import sys

    script = (f"import os, signal\nfrom specfork import LLM\nllm = LLM({draft_pair['target']!r}, tensor_parallel_size=2)\n"
              "print(llm.engine.parallel.workers[0].pid, flush=True)\nos.kill(os.getpid(), signal.SIGKILL)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    assert _gone(int(done.stdout.split()[-1]), within_s=10)
