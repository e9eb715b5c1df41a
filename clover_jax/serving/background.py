"""`clover serve`'s app on a loopback port in a thread of this process: for notebooks, tests and benchmarks.

    with serve_in_background(engine, tokenizer, "clover-tiny") as server:
        client = openai.OpenAI(base_url=server.url, api_key="none")
        ...

The engine must already be started (`Engine.start`, after `warm_up` if compile time should not land on the
first request); leaving the block stops the HTTP server and drains the engine. Nothing here listens beyond
127.0.0.1: a server others reach is `clover serve`, with its authentication and limits. Needs the `serve` extra.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BackgroundServer:
    """A running server: its loopback port and the base URL an OpenAI client takes."""

    port: int

    @property
    def url(self) -> str:
        """`http://127.0.0.1:PORT/v1`."""
        return f"http://127.0.0.1:{self.port}/v1"


@contextmanager
def serve_in_background(engine: Any, tokenizer: Any, model_name: str, *, defaults: dict[str, Any] | None = None,
                        start_timeout: float = 60.0, drain_timeout: float = 60.0) -> Iterator[BackgroundServer]:
    """Serve `make_app(engine, tokenizer, model_name, defaults=defaults)` with uvicorn on a free 127.0.0.1 port in a
    daemon thread. `defaults`: what a request leaves out gets, as `clover serve` takes them from a checkpoint
    (`http_request.request_defaults` of `loading.sampler_defaults`); None: the sampler's own.

    Yields once the socket listens; RuntimeError if it does not within `start_timeout` seconds. On exit the
    server stops taking requests, its thread is joined and `engine` drained (requests in flight finish).
    """
    import uvicorn

    from clover_jax.serving.api import make_app

    app = make_app(engine, tokenizer, model_name, defaults=defaults)
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=srv.run, name="clover-serve-background", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not (srv.started and srv.servers):
        if not thread.is_alive() or time.monotonic() > deadline:
            srv.should_exit = True
            raise RuntimeError(f"the background server did not start listening within {start_timeout:.0f} s")
        time.sleep(0.05)
    try:
        yield BackgroundServer(srv.servers[0].sockets[0].getsockname()[1])
    finally:
        srv.should_exit = True
        thread.join(30)
        engine.drain(timeout=drain_timeout)
