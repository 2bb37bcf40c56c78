"""The server's engine loop in-process: one failing request fails alone, a broken engine says so,
drain cuts what runs with finish_reason "abort"."""

from __future__ import annotations

import asyncio
import time

import pytest

from specfork import LLM, SamplingParams
from specfork.serve.engine_loop import (
    MAX_FAILED_STEPS,
    Admitted,
    EngineLoop,
    EngineStopped,
    Failed,
    Finished,
    Piece,
)

PROMPT = [1, 5, 9, 13]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def loop(tiny_checkpoints):
    path = str(tiny_checkpoints["llama-gqa-tied"].path)
    finished = []
    engine_loop = EngineLoop(lambda: LLM(path, deterministic=True, max_model_len=256), max_queue=4,
                             on_finished=finished.append)
    engine_loop.start()
    engine_loop.finished = finished
    yield engine_loop
    engine_loop.shutdown()


@pytest.fixture(scope="module")
def expected(tiny_checkpoints):
    return LLM(str(tiny_checkpoints["llama-gqa-tied"].path), deterministic=True).generate([PROMPT], GREEDY)[0].token_ids


async def _last_events(loop: EngineLoop, requests: list[tuple[list[int], SamplingParams]], timeout: float = 60):
    """Submit every request, then wait for each one's last event."""
    groups = [loop.submit([prompt], [params]) for prompt, params in requests]

    async def last(group):
        tokens = []
        while True:
            _, event = await asyncio.wait_for(group.events.get(), timeout)
            if isinstance(event, Piece):
                tokens += event.token_ids
            elif not isinstance(event, Admitted):
                return event, tokens

    return await asyncio.gather(*(last(g) for g in groups))


def _bad_seed() -> SamplingParams:
    """What the issue's request reached the engine with before SamplingParams checked the range."""
    params = SamplingParams(temperature=0.7, max_tokens=4, seed=1)
    object.__setattr__(params, "seed", 2**64)
    return params


def test_a_request_that_fails_in_the_engine_fails_alone(loop, expected):
    (bad, _), (good, tokens) = asyncio.run(_last_events(loop, [(PROMPT, _bad_seed()), (PROMPT, GREEDY)]))
    assert isinstance(bad, Failed) and bad.status == 500
    assert "Overflow" not in bad.message  # internal details stay in the log
    assert isinstance(good, Finished) and good.output.token_ids == tokens == expected
    assert loop.state == ("ok", None)
    (again, _), = asyncio.run(_last_events(loop, [(PROMPT, GREEDY)]))
    assert isinstance(again, Finished) and again.output.token_ids == expected


def test_a_request_the_engine_refuses_is_a_400(loop):
    too_long = SamplingParams(max_tokens=253)  # 4 + 253 > max_model_len 256
    (refused, _), = asyncio.run(_last_events(loop, [(PROMPT, too_long)]))
    assert isinstance(refused, Failed) and refused.status == 400
    assert "253" in refused.message and "256" in refused.message
    assert loop.state == ("ok", None)


def test_a_failing_batch_fails_its_requests_and_the_engine_goes_on(loop, expected, monkeypatch):
    step = loop.llm.engine.step_strategy
    real, calls = step.execute, []

    def execute_once_broken(batch):
        calls.append(batch)
        if len(calls) == 1:
            raise RuntimeError("secret internal detail")
        return real(batch)

    monkeypatch.setattr(step, "execute", execute_once_broken)
    (failed, _), = asyncio.run(_last_events(loop, [(PROMPT, GREEDY)]))
    assert isinstance(failed, Failed) and failed.status == 500 and "secret" not in failed.message
    assert loop.llm.engine.block_manager.num_used_blocks == 0  # its KV blocks were freed
    (ok, _), = asyncio.run(_last_events(loop, [(PROMPT, GREEDY)]))
    assert isinstance(ok, Finished) and ok.output.token_ids == expected
    assert [o.finish_reason for o in loop.finished] == ["error", "length"]
    assert loop.state == ("ok", None)


def test_steps_that_keep_failing_mean_the_engine_failed(loop, monkeypatch):
    def broken(batch):
        raise RuntimeError("the model is broken")

    monkeypatch.setattr(loop.llm.engine.step_strategy, "execute", broken)
    for _ in range(MAX_FAILED_STEPS):
        (failed, _), = asyncio.run(_last_events(loop, [(PROMPT, GREEDY)]))
        assert isinstance(failed, Failed) and failed.status == 500
    deadline = time.monotonic() + 10
    while loop.state[0] != "failed" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loop.state[0] == "failed" and "engine failed" in loop.state[1]

    async def submit():
        loop.submit([PROMPT], [GREEDY])

    with pytest.raises(EngineStopped, match="failed"):
        asyncio.run(submit())


def test_a_fault_outside_any_request_stops_the_engine_and_answers_503(loop, monkeypatch):
    def broken_step():
        raise RuntimeError("scheduler bug")

    monkeypatch.setattr(loop.llm.engine, "step", broken_step)
    (failed, _), = asyncio.run(_last_events(loop, [(PROMPT, GREEDY)]))
    assert isinstance(failed, Failed) and failed.status == 503
    assert loop.state == ("failed", "the engine failed (RuntimeError); see the server log")


def test_drain_cuts_what_still_runs_with_abort(loop):
    long = SamplingParams(temperature=0.0, max_tokens=240, ignore_eos=True)

    async def run():
        group = loop.submit([PROMPT], [long])
        while not isinstance((await group.events.get())[1], Piece):
            pass
        loop.drain(0.0)
        with pytest.raises(EngineStopped):
            loop.submit([PROMPT], [GREEDY])
        while True:
            _, event = await asyncio.wait_for(group.events.get(), 30)
            if isinstance(event, Finished | Failed):
                return event

    last = asyncio.run(run())
    assert isinstance(last, Finished) and last.output.finish_reason == "abort"
    assert 0 < len(last.output.token_ids) < 240
    assert loop.finished[-1].finish_reason == "abort"  # counted in the metrics as abort
    assert loop.llm.engine.block_manager.num_used_blocks == 0
