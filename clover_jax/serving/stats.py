"""The serving engine's counters (`Counters`, the scheduler's, guarded by its lock) and their snapshot
(`EngineStats`, what `Engine.stats()` gives `/metrics` and the benchmarks)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's counters."""

    requests_admitted: int
    requests_finished: int
    tokens_generated: int
    program_passes: int  # forward passes the device ran (each over a whole batch bucket)
    row_passes: int  # sum over requests of the passes they took part in
    queue_depth: int
    active_rows: int
    capacity: int  # the largest batch bucket
    blocks_run: int  # block-program calls
    rows_in_blocks: int  # sum over block calls of the rows that ran a request
    prefill_calls: int = 0  # admission calls (each prefills one or more new requests' prompts together)
    rows_prefilled: int = 0  # requests admitted by them
    prefix_lookups: int = 0  # admissions (and lane requests) that looked in the prefix cache (it is on)
    prefix_hits: int = 0  # ... and reused a saved prompt's cache
    prefix_tokens_reused: int = 0  # prompt tokens those hits did not prefill
    prefix_entries: int = 0  # saved prompts held now
    prefix_bytes: int = 0  # their device memory

    @property
    def tokens_per_pass(self) -> float:
        """Tokens committed per forward pass per request: the parallelism of decoding."""
        return self.tokens_generated / self.row_passes if self.row_passes else 0.0

    @property
    def mean_rows_per_prefill(self) -> float:
        """Requests per admission call: how many queued prompts each prefill took together."""
        return self.rows_prefilled / self.prefill_calls if self.prefill_calls else 0.0

    @property
    def mean_rows_per_block(self) -> float:
        """Requests per block call: how full the batches were."""
        return self.rows_in_blocks / self.blocks_run if self.blocks_run else 0.0


@dataclass
class AdmissionTally:
    """What one round of admissions did (`admission.Admission.admit`), added to the counters at once."""

    calls: int = 0  # admission program calls
    rows: int = 0  # requests admitted
    lookups: int = 0  # prefix-cache lookups (one per request while it is on)
    hits: int = 0
    reused: int = 0  # prompt tokens taken from saved prompts


@dataclass
class Counters:
    """The scheduler's running totals (see `EngineStats` for each one's meaning)."""

    admitted: int = 0
    finished: int = 0
    tokens: int = 0
    program_passes: int = 0
    row_passes: int = 0
    blocks: int = 0
    rows_in_blocks: int = 0
    prefill_calls: int = 0
    rows_prefilled: int = 0
    prefix_lookups: int = 0
    prefix_hits: int = 0
    prefix_tokens_reused: int = 0
    spec_running: int = 0  # self-speculative requests on their lane now

    def add(self, tally: AdmissionTally) -> None:
        """Count a round of admissions."""
        self.prefill_calls += tally.calls
        self.rows_prefilled += tally.rows
        self.prefix_lookups += tally.lookups
        self.prefix_hits += tally.hits
        self.prefix_tokens_reused += tally.reused

    def snapshot(self, queue_depth: int, active_rows: int, capacity: int, entries: int, nbytes: int) -> EngineStats:
        """The counters with the engine's gauges, as an `EngineStats`."""
        return EngineStats(self.admitted, self.finished, self.tokens, self.program_passes, self.row_passes,
                           queue_depth, active_rows, capacity, self.blocks, self.rows_in_blocks, self.prefill_calls,
                           self.rows_prefilled, self.prefix_lookups, self.prefix_hits, self.prefix_tokens_reused,
                           entries, nbytes)
