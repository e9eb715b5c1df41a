"""Prometheus text exposition (format 0.0.4) for `clover serve`'s `GET /metrics`, written by hand.

`Metrics` holds what only the HTTP layer sees (requests by endpoint and status code, latency
histograms); the engine's counters and gauges come from an `EngineStats` snapshot passed to
`Metrics.render`. Every method is thread-safe.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Sequence
from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Upper bounds in seconds (a +Inf bucket is always added).
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
FIRST_BLOCK_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _num(x: float) -> str:
    """A sample value as Prometheus reads it (integers without a fraction, +Inf/-Inf/NaN spelled out)."""
    if isinstance(x, int):
        return str(x)
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x))


def _labels(pairs: dict[str, str]) -> str:
    if not pairs:
        return ""
    esc = {k: v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for k, v in pairs.items()}
    return "{" + ",".join(f'{k}="{v}"' for k, v in esc.items()) + "}"


def _family(name: str, kind: str, doc: str, samples: Iterable[tuple[str, dict[str, str], float]]) -> list[str]:
    """HELP and TYPE lines of one metric family, then its samples (suffix, labels, value)."""
    lines = [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{suffix}{_labels(labels)} {_num(value)}" for suffix, labels, value in samples]
    return lines


class Histogram:
    """Fixed-bucket histogram: cumulative bucket counts, sum and count."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        """Count `value` (seconds) into the first bucket whose bound is >= it."""
        i = next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        self.counts[i] += 1
        self.sum += value
        self.count += 1

    def samples(self) -> list[tuple[str, dict[str, str], float]]:
        """The _bucket (cumulative, le labels), _sum and _count samples."""
        out, running = [], 0
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            running += n
            out.append(("_bucket", {"le": "+Inf" if math.isinf(bound) else f"{bound:g}"}, running))
        return [*out, ("_sum", {}, self.sum), ("_count", {}, self.count)]


class Metrics:
    """The HTTP layer's counters and histograms."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: dict[tuple[str, str], int] = {}
        self._submitted = 0
        self._ended: dict[str, int] = {}
        self._timed_out = 0
        self._tool_calls: dict[tuple[str, str], int] = {}
        self.latency = Histogram(LATENCY_BUCKETS)
        self.first_block = Histogram(FIRST_BLOCK_BUCKETS)

    def count_request(self, endpoint: str, status: int) -> None:
        """One answered HTTP request to `endpoint` (a route path) with status code `status`."""
        with self._lock:
            key = (endpoint, str(status))
            self._requests[key] = self._requests.get(key, 0) + 1

    def count_submitted(self) -> None:
        """One generation (a choice) the engine took."""
        with self._lock:
            self._submitted += 1

    def count_ended(self, finish_reason: str) -> None:
        """The engine's final event of one generation (called from the engine's thread)."""
        with self._lock:
            self._ended[finish_reason] = self._ended.get(finish_reason, 0) + 1

    def count_timeout(self) -> None:
        """One HTTP request that passed its deadline (`--request-timeout`)."""
        with self._lock:
            self._timed_out += 1

    def count_tool_call(self, written: str, valid: bool) -> None:
        """One answer that opened a tool call (or had to hold one): `written` "model" (as the model wrote it) or
        "scaffold" (its frame written into the canvas, `serving.scaffold`); `valid`: it parsed and fit the schema."""
        with self._lock:
            key = (written, "valid" if valid else "malformed")
            self._tool_calls[key] = self._tool_calls.get(key, 0) + 1

    def generations(self) -> tuple[int, int]:
        """(submitted, ended): every generation submitted ends in exactly one final engine event, so once
        the server is idle the two are equal."""
        with self._lock:
            return self._submitted, sum(self._ended.values())

    def observe_generation(self, first_block_s: float, total_s: float) -> None:
        """One finished generation: seconds to its first block and in all."""
        with self._lock:
            self.first_block.observe(first_block_s)
            self.latency.observe(total_s)

    def render(self, stats: Any | None) -> str:
        """The exposition text: the HTTP metrics, plus the engine's from `stats` (an EngineStats) when given."""
        with self._lock:
            lines = _family("clover_requests_total", "counter", "HTTP requests answered, by endpoint and status code",
                            [("", {"endpoint": e, "status": s}, n) for (e, s), n in sorted(self._requests.items())])
            lines += _family("clover_request_latency_seconds", "histogram",
                             "Seconds from a generation request's arrival to its last token", self.latency.samples())
            lines += _family("clover_time_to_first_block_seconds", "histogram",
                             "Seconds from a generation request's arrival to its first committed block",
                             self.first_block.samples())
            ended = sum(self._ended.values())
            lines += _family("clover_generations_submitted_total", "counter",
                             "Generations (choices) the HTTP layer submitted to the engine",
                             [("", {}, self._submitted)])
            lines += _family("clover_generations_ended_total", "counter",
                             "Generations whose final engine event arrived, by finish reason",
                             [("", {"finish_reason": r}, n) for r, n in sorted(self._ended.items())])
            lines += _family("clover_generations_in_flight", "gauge",
                             "Generations submitted whose final engine event has not arrived yet",
                             [("", {}, self._submitted - ended)])
            lines += _family("clover_requests_timed_out_total", "counter",
                             "HTTP requests that passed the server's --request-timeout", [("", {}, self._timed_out)])
            lines += _family("clover_tool_calls_total", "counter",
                             "Answers that opened or had to hold a tool call, by who wrote it and whether it was valid",
                             [("", {"written": w, "result": r}, n) for (w, r), n in sorted(self._tool_calls.items())])
        if stats is not None:
            lines += engine_lines(stats)
        return "\n".join(lines) + "\n"


def engine_lines(stats: Any) -> list[str]:
    """Counter and gauge families of an EngineStats snapshot."""
    def one(name: str, kind: str, doc: str, value: float) -> list[str]:
        return _family(name, kind, doc, [("", {}, value)])

    tokens_per_pass = stats.tokens_generated / stats.row_passes if stats.row_passes else 0.0
    rows_per_block = stats.rows_in_blocks / stats.blocks_run if stats.blocks_run else 0.0
    return [
        *one("clover_generated_tokens_total", "counter", "Tokens generated", stats.tokens_generated),
        *one("clover_forward_passes_total", "counter", "Forward passes the device ran (each over a batch bucket)",
             stats.program_passes),
        *one("clover_row_passes_total", "counter", "Forward passes summed over the requests that took part in them",
             stats.row_passes),
        *one("clover_blocks_total", "counter", "Block-program calls", stats.blocks_run),
        *one("clover_prefill_calls_total", "counter", "Admission calls (each prefills one or more prompts together)",
             stats.prefill_calls),
        *one("clover_prefilled_requests_total", "counter", "Generations admitted by those calls",
             stats.rows_prefilled),
        *one("clover_prefix_cache_lookups_total", "counter", "Admissions that looked in the prefix cache",
             stats.prefix_lookups),
        *one("clover_prefix_cache_hits_total", "counter", "Admissions that reused a saved prompt's cache",
             stats.prefix_hits),
        *one("clover_prefix_cache_reused_tokens_total", "counter", "Prompt tokens the prefix cache spared a prefill",
             stats.prefix_tokens_reused),
        *one("clover_prefix_cache_entries", "gauge", "Saved prompts in the prefix cache", stats.prefix_entries),
        *one("clover_prefix_cache_bytes", "gauge", "Device memory of the prefix cache", stats.prefix_bytes),
        *one("clover_requests_admitted_total", "counter", "Generations the engine admitted", stats.requests_admitted),
        *one("clover_requests_finished_total", "counter", "Generations the engine finished",
             stats.requests_finished),
        *one("clover_queue_depth", "gauge", "Generations waiting for a batch row", stats.queue_depth),
        *one("clover_active_rows", "gauge", "Batch rows generating now", stats.active_rows),
        *one("clover_batch_capacity", "gauge", "Rows of the largest batch bucket", stats.capacity),
        *one("clover_tokens_per_pass", "gauge", "Tokens generated per forward pass a request took part in",
             float(tokens_per_pass)),
        *one("clover_mean_rows_per_block", "gauge", "Mean active rows per block-program call", float(rows_per_block)),
    ]
