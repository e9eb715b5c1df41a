"""Run serving requests through an `Engine` to the end: the tests' one way to submit a batch and collect it."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from clover_jax.serving.engine import Engine
from clover_jax.serving.requests import Event, Request


def serve(eng: Engine, reqs: Sequence[Request], together: bool = False, timeout: float = 600.0,
          drain: bool = False) -> list[list[Event]]:
    """Submit `reqs` in order, start the engine (if it is not running) and wait until every one has its last
    event; each request's events, in order. `together`: submitted under the engine's lock, so the scheduler sees
    them all at once (admitted as one batch when the rows allow). `drain`: drain the engine after."""
    events: list[list[Event]] = [[] for _ in reqs]
    done = threading.Event()
    lock = threading.Lock()

    def sink(i: int):
        def on_event(ev: Event) -> None:
            with lock:
                events[i].append(ev)
                if all(evs and evs[-1].finish_reason for evs in events):
                    done.set()
        return on_event

    if together:
        with eng._lock:
            for i, r in enumerate(reqs):
                eng.submit(r, sink(i))
    else:
        for i, r in enumerate(reqs):
            eng.submit(r, sink(i))
    eng.start()
    assert done.wait(timeout), f"requests did not finish in {timeout} s: {events}"
    if drain:
        eng.drain()
    return events


def tokens(events: list[Event]) -> list[int]:
    """A request's tokens over its events."""
    return [t for ev in events for t in ev.tokens]
