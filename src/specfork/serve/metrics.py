"""Server metrics in the Prometheus text exposition format (version 0.0.4)."""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

from specfork.outputs import RequestOutput
from specfork.serve.engine_loop import EngineSnapshot

FINISH_REASONS = ("stop", "length", "abort", "error")  # always rendered, 0 until seen
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(init=False)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.total += value
        self.n += 1

    def lines(self, name: str) -> list[str]:
        out, cumulative = [], 0
        for bound, count in zip(self.buckets, self.counts, strict=True):
            cumulative += count
            out.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
        out += [f'{name}_bucket{{le="+Inf"}} {self.n}', f"{name}_sum {self.total}", f"{name}_count {self.n}"]
        return out


class ServerMetrics:
    """Counters fed by ended requests (engine thread: finished, aborted or failed) and by the
    HTTP side (event loop: error replies, clients that went away)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.finished: dict[str, int] = dict.fromkeys(FINISH_REASONS, 0)
        self.errors: dict[int, int] = {}
        self.disconnects = 0
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.tpot = Histogram(TOKEN_LATENCY_BUCKETS)
        self.e2e = Histogram(LATENCY_BUCKETS)
        self.spec_rounds = 0
        self.spec_rounds_without_drafts = 0
        self.spec_tokens_emitted = 0
        self.draft_proposed = 0
        self.draft_accepted = 0
        self.ssd_requests = 0
        self.ssd_hits = 0

    def request_finished(self, output: RequestOutput) -> None:
        m = output.metrics
        with self._lock:
            self.finished[output.finish_reason] = self.finished.get(output.finish_reason, 0) + 1
            self.prompt_tokens += m["num_prompt_tokens"]
            self.cached_prompt_tokens += m.get("num_cached_prompt_tokens", 0)
            self.generation_tokens += m["num_generated_tokens"]
            if m.get("ttft_s") is not None:
                self.ttft.observe(m["ttft_s"])
            if m.get("tpot_s") is not None:
                self.tpot.observe(m["tpot_s"])
            self.e2e.observe(m["time_s"])
            self.spec_rounds += m.get("spec_rounds", 0)
            self.spec_rounds_without_drafts += m.get("spec_rounds_without_drafts", 0)
            self.spec_tokens_emitted += m.get("spec_tokens_emitted", 0)
            self.draft_proposed += m.get("draft_tokens_proposed", 0)
            self.draft_accepted += m.get("draft_tokens_accepted", 0)
            self.ssd_requests += m.get("ssd_requests", 0)
            self.ssd_hits += m.get("ssd_cache_hits", 0)

    def request_failed(self, status: int) -> None:
        with self._lock:
            self.errors[status] = self.errors.get(status, 0) + 1

    def client_disconnected(self) -> None:
        with self._lock:
            self.disconnects += 1

    def render(self, engine: EngineSnapshot, active: int, state: str) -> str:
        with self._lock:
            lines: list[str] = []

            def metric(name: str, kind: str, help_text: str, samples: list[str]) -> None:
                lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples])

            def scalar(name: str, kind: str, help_text: str, value: object) -> None:
                metric(name, kind, help_text, [f"{name} {value}"])

            metric("specfork_requests_finished_total", "counter",
                   "Generations that ended, by finish reason: one per choice, so a request with n = 4 counts 4 "
                   "(abort: cancelled by the client or at shutdown; error: failed while running).",
                   [f'specfork_requests_finished_total{{finish_reason="{r}"}} {n}'
                    for r, n in sorted(self.finished.items())])
            metric("specfork_request_errors_total", "counter", "Requests refused or failed, by HTTP status.",
                   [f'specfork_request_errors_total{{status="{s}"}} {n}' for s, n in sorted(self.errors.items())]
                   or ['specfork_request_errors_total{status="400"} 0'])
            scalar("specfork_client_disconnects_total", "counter",
                   "Requests whose client went away before the end (streamed or not).", self.disconnects)
            scalar("specfork_prompt_tokens_total", "counter", "Prompt tokens of finished requests.", self.prompt_tokens)
            scalar("specfork_prompt_tokens_cached_total", "counter", "Prompt tokens of finished requests whose KV "
                   "the prefix cache held (not computed again).", self.cached_prompt_tokens)
            scalar("specfork_generation_tokens_total", "counter", "Tokens generated by finished requests.", self.generation_tokens)
            metric("specfork_time_to_first_token_seconds", "histogram", "Time from arrival to the first token.",
                   self.ttft.lines("specfork_time_to_first_token_seconds"))
            metric("specfork_time_per_output_token_seconds", "histogram", "Mean time per output token after the first.",
                   self.tpot.lines("specfork_time_per_output_token_seconds"))
            metric("specfork_e2e_request_latency_seconds", "histogram", "Time from arrival to the last token.",
                   self.e2e.lines("specfork_e2e_request_latency_seconds"))
            scalar("specfork_spec_rounds_total", "counter", "Speculative rounds (target verification passes), "
                   "plain ones included.", self.spec_rounds)
            scalar("specfork_spec_rounds_without_drafts_total", "counter", "Rounds that verified no drafts (k auto "
                   "chose plain decoding, or nothing was proposed): each gives one token.",
                   self.spec_rounds_without_drafts)
            scalar("specfork_spec_draft_tokens_total", "counter", "Draft tokens proposed.", self.draft_proposed)
            scalar("specfork_spec_accepted_tokens_total", "counter", "Draft tokens accepted.", self.draft_accepted)
            rate = self.draft_accepted / self.draft_proposed if self.draft_proposed else 0.0
            scalar("specfork_spec_acceptance_rate", "gauge", "Accepted / proposed draft tokens so far.", rate)
            mean_len = self.spec_tokens_emitted / self.spec_rounds if self.spec_rounds else 0.0
            scalar("specfork_spec_mean_accepted_length", "gauge",
                   "Tokens per target forward in speculative rounds (bonus token included; a round without "
                   "drafts gives 1).", mean_len)
            scalar("specfork_ssd_cache_lookups_total", "counter", "SSD speculation-cache lookups.", self.ssd_requests)
            scalar("specfork_ssd_cache_hits_total", "counter", "SSD speculation-cache hits.", self.ssd_hits)
            hit_rate = self.ssd_hits / self.ssd_requests if self.ssd_requests else 0.0
            scalar("specfork_ssd_cache_hit_rate", "gauge", "SSD cache hits / lookups so far.", hit_rate)
        health = engine.health
        scalar("specfork_drafter_failures_total", "counter",
               "SSD drafter process failures (timeouts, crashes, failed starts).", health.drafter_failures)
        scalar("specfork_drafter_restarts_total", "counter", "SSD drafter processes restarted after a failure.", health.drafter_restarts)
        scalar("specfork_degraded", "gauge", "1 while decoding runs below its configured mode (e.g. SSD drafter down).", int(health.degraded is not None))
        scalar("specfork_engine_failed", "gauge", "1 once the engine failed for good (/health says failed).", int(state == 'failed'))
        scalar("specfork_num_requests_running", "gauge", "Sequences in the running batch.", engine.running)
        scalar("specfork_num_requests_waiting", "gauge", "Requests queued for the engine (the queue length).", max(engine.waiting, active - engine.running))
        scalar("specfork_kv_cache_blocks_used", "gauge", "KV-cache blocks in use.", engine.kv_blocks_used)
        scalar("specfork_kv_cache_usage", "gauge", "Fraction of KV-cache blocks in use.", engine.kv_blocks_used / engine.kv_blocks_total if engine.kv_blocks_total else 0.0)
        return "\n".join(lines) + "\n"
