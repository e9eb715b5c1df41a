"""`clover serve`: an OpenAI-compatible HTTP server over the batching engine.

    clover serve --port 8000
    curl localhost:8000/v1/completions -d '{"prompt": "Once upon a time", "max_tokens": 64}'

    CLOVER_API_KEY=$(cat key) clover serve --host 0.0.0.0     # on a network: with an API key
    curl HOST:8000/v1/models -H "Authorization: Bearer $(cat key)"

Every batch bucket's programs are compiled before the socket listens; "clover serve: listening on
http://HOST:PORT" on stderr says the server is ready (with --port 0 it names the port picked).
SIGTERM or SIGINT drains: new requests get 503 while the engine finishes everything it holds and the
streams in flight are sent to the end, then the server exits ("clover serve: drained, exiting"). A
second signal exits at once. Needs the `serve` extra: pip install 'clover-jax[serve]'.

On a network: API keys (--api-key, --api-key-file, CLOVER_API_KEY; any of them is accepted as
`Authorization: Bearer KEY` on every route but /health, 401 otherwise; without one, a host other
than loopback gets a warning line). Limits: --max-body-bytes (413), --max-messages, --max-n (n > 1
is served, one engine row per choice, up to this; more is a 400), --max-prompt / --max-tokens (400),
--queue-size (429), --request-timeout (a request still generating then ends: its unfinished choices
get finish_reason "length" with the text so far and the response / final chunk says
"timed_out": true; its rows free at the next block boundary). Every request gets one access line
(request id, also sent back as X-Request-Id, method, path, status, tokens in / out, passes, queue
and run time) in --log-format text (key=value) or json (one object per line).
"""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import os
import re
import socket
import stat
import threading
from typing import Any

from clover_jax import loading
from clover_jax.commands.memory_flags import add_memory_arguments, with_memory_flags
from clover_jax.errors import UsageError
from clover_jax.mesh.layouts import add_mesh_argument
from clover_jax.sampler.settings import SamplerConfig

CACHE_MODES = ("auto", "none", "prefix")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
GRACEFUL_S = 30  # after the drain: how long responses still being sent may take before they are cut
LOG_FORMATS = ("text", "json")
API_KEY_ENV = "CLOVER_API_KEY"
KEY_CHARS = re.compile(r"[\x21-\x7e]+")  # printable ASCII, no space: what a Bearer token can carry as is
REQUEST_TIMEOUT_S = 600.0


# token classes a request's scaffold may define (a tool call's value types): the engine holds them per row
SCAFFOLD_CLASSES = 8

def register(sub: argparse._SubParsersAction) -> None:
    """Add the `serve` subcommand to `sub`; it dispatches to `run`."""
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="checkpoint directory or preset name (random weights); default: the shipped clover-tiny model")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: any free port)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16], metavar="N",
                   help="the compiled batch buckets (default 1 2 4 8 16)")
    p.add_argument("--block-length", type=int, default=None,
                   help="tokens per block (default: the checkpoint's generation_config.json, else 32; at most the "
                        "model's own blocks for Clover's Gated DeltaNet)")
    p.add_argument("--max-prompt", type=int, default=None, help="longest prompt in tokens (default: the engine's)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="most tokens a request may ask for (default: the engine's)")
    p.add_argument("--prefill-rows", type=int, default=4, metavar="N",
                   help="queued requests admitted together, their prompts prefilled as one batch (default 4; "
                        "1: one at a time; each size up to N is a compiled program per prompt width)")
    p.add_argument("--prefix-cache-gb", type=float, default=1.0, metavar="GB",
                   help="device memory for the caches of earlier prompts, reused exactly when a new prompt begins "
                        "with one, least recently used first out (default 1; 0: off)")
    p.add_argument("--tool-calls", choices=("scaffold", "free"), default="scaffold",
                   help="a tool call the model does not write whole and valid (or that tool_choice requires): "
                        "scaffold (default) writes its frame and keys into the canvas and the model fills in the "
                        "values; free leaves the model's text as it is")
    p.add_argument("--queue-size", type=int, default=256,
                   help="requests that may wait for a batch row; more get HTTP 429 (default 256)")
    p.add_argument("--cache", choices=CACHE_MODES, default="auto",
                   help="auto (default): the exact prefix cache for block-causal models, none otherwise")
    p.add_argument("--self-speculative", action="store_true",
                   help="also serve requests that ask for self-speculative decoding ('diffusion': "
                        "{'self_speculative': true}: the causal model's greedy text, drafted by the block "
                        "diffusion) or causal decoding ({'causal': true}: the same text one token a pass, as an "
                        "autoregressive model decodes); each runs alone and arrives in one piece; a causal-prefix "
                        "model's")
    p.add_argument("--dispatch", default=None, help="MoE dispatch (default: the model's, or the mesh's)")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                   help="log level of every line (default info; warning hides the access lines)")
    p.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                   help="text: 'clover serve: ...' lines, access lines as key=value; json: one object per line "
                        "(default text)")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="accept requests that send 'Authorization: Bearer KEY' (repeatable; every route but "
                        "/health then needs one). A key here shows in `ps`: prefer --api-key-file or the "
                        f"{API_KEY_ENV} environment variable. Make one: python -c 'import secrets; "
                        "print(secrets.token_urlsafe(32))'")
    p.add_argument("--api-key-file", action="append", default=None, metavar="FILE",
                   help="read API keys from FILE, one per line (blank lines and lines starting with # ignored; "
                        "repeatable); keys of all sources are accepted")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, metavar="N",
                   help="largest request body in bytes; a larger one gets HTTP 413 before it is read "
                        "(default 1048576)")
    p.add_argument("--max-messages", type=int, default=256, metavar="N",
                   help="most messages a chat completion may send (default 256)")
    p.add_argument("--max-n", type=int, default=8, metavar="N",
                   help="most choices (n) per request; each runs in its own batch row and takes a queue place, "
                        "and more is HTTP 400 (default 8; 1 refuses n > 1)")
    p.add_argument("--request-timeout", type=float, default=REQUEST_TIMEOUT_S, metavar="S",
                   help="seconds a request may take from arrival; then its unfinished choices end with "
                        "finish_reason 'length' (the text so far), the response or its final chunk says "
                        "\"timed_out\": true, and its rows free at the next block boundary "
                        f"(default {REQUEST_TIMEOUT_S:g}; 0: no deadline)")
    add_memory_arguments(p)
    add_mesh_argument(p)
    p.set_defaults(func=run)


def check_flags(args: argparse.Namespace) -> None:
    """UsageError naming the first flag out of range (before anything is loaded)."""
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    if any(b < 1 for b in args.batch_sizes):
        raise UsageError(f"--batch-sizes must all be >= 1, got {' '.join(map(str, args.batch_sizes))}")
    for flag, value in (("--block-length", args.block_length), ("--max-prompt", args.max_prompt),
                        ("--max-tokens", args.max_tokens), ("--queue-size", args.queue_size),
                        ("--prefill-rows", args.prefill_rows),
                        ("--max-messages", args.max_messages), ("--max-n", args.max_n)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    if not args.prefix_cache_gb >= 0 or args.prefix_cache_gb == float("inf"):
        raise UsageError(f"--prefix-cache-gb must be a number of GB >= 0 (0: off), got {args.prefix_cache_gb}")
    if args.max_body_bytes < 1024:
        raise UsageError(f"--max-body-bytes must be >= 1024, got {args.max_body_bytes}")
    if not (args.request_timeout >= 0 and args.request_timeout < float("inf")):
        raise UsageError(f"--request-timeout must be a number of seconds >= 0 (0: none), got {args.request_timeout}")
    if args.dispatch is not None:
        from clover_jax.model.moe import get_dispatch

        try:
            get_dispatch(args.dispatch)
        except ValueError as e:
            raise UsageError(f"--dispatch: {e}") from e


def check_installed() -> None:
    """UsageError when the `serve` extra is missing."""
    missing = [m for m in ("fastapi", "uvicorn", "sse_starlette") if importlib.util.find_spec(m) is None]
    if missing:
        raise UsageError(f"clover serve needs {', '.join(missing)}: pip install 'clover-jax[serve]'")


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (not listening yet: connections wait for `serve`). UsageError when
    the address cannot be had (in use, not this host's)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except OSError as e:
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def url(sock: socket.socket) -> str:
    """http://HOST:PORT of a bound socket (IPv6 hosts in brackets)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


_LOG = {"format": "text"}  # --log-format of this process's server (`run` sets it)


def _say(message: str, level: str = "info") -> None:
    from clover_jax.serving.logs import say

    say(message, _LOG["format"], level)


def _check_key(key: str, where: str) -> str:
    """`key`, or UsageError naming `where` (never the key) when it cannot be sent as a Bearer token."""
    if not KEY_CHARS.fullmatch(key):
        raise UsageError(f"the API key of {where} is empty or has a space, a control or a non-ASCII character")
    return key


def read_key_file(path: str) -> list[str]:
    """The keys of an --api-key-file: one per line, blank lines and lines starting with # skipped.
    UsageError when it cannot be read or holds no key (messages never show a key)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
        mode = os.stat(path).st_mode
    except (OSError, UnicodeDecodeError) as e:
        why = getattr(e, "strerror", None) or e.__class__.__name__
        raise UsageError(f"--api-key-file {path}: cannot read it ({why})") from None
    keys = [_check_key(line.strip(), f"--api-key-file {path} line {i}")
            for i, line in enumerate(lines, 1) if line.strip() and not line.strip().startswith("#")]
    if not keys:
        raise UsageError(f"--api-key-file {path} holds no key")
    if mode & stat.S_IROTH:
        _say(f"--api-key-file {path} is readable by every user (chmod 600 it)", "warning")
    return keys


def api_keys(args: argparse.Namespace, environ: dict[str, str] | None = None) -> list[str]:
    """Every key the server accepts: --api-key flags, --api-key-file files and $CLOVER_API_KEY (one key;
    an empty variable counts as unset), duplicates dropped. UsageError for a key that cannot be sent."""
    env = os.environ if environ is None else environ
    keys = [_check_key(k, f"--api-key #{i}") for i, k in enumerate(args.api_key or [], 1)]
    for path in args.api_key_file or []:
        keys += read_key_file(path)
    if env.get(API_KEY_ENV, "").strip():
        keys.append(_check_key(env[API_KEY_ENV].strip(), f"${API_KEY_ENV}"))
    return list(dict.fromkeys(keys))


def is_loopback(host: str) -> bool:
    """Whether `host` (a --host value) only listens on this machine."""
    if host.strip().lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, keys: list[str]) -> str | None:
    """The warning line for a server reachable from other machines without an API key (else None)."""
    if keys or is_loopback(host):
        return None
    return (f"listening on {host} without an API key: anyone who can reach this port can use the model "
            f"(--api-key-file FILE, --api-key KEY or ${API_KEY_ENV})")


def limits(args: argparse.Namespace) -> Any:
    """The api.Limits of the flags."""
    from clover_jax.serving.api import Limits

    return Limits(max_body_bytes=args.max_body_bytes, max_messages=args.max_messages, max_n=args.max_n,
                  request_timeout_s=args.request_timeout or None)


def _compiled(line: str) -> None:
    _say(line if line.startswith("compiled") else f"compiled {line}")


def check_defaults(defaults: dict[str, Any], engine: Any, where: str) -> None:
    """UsageError, before anything compiles, when a request default from the checkpoint (`request_defaults`) is
    one this server would refuse every request for (a steps_per_block above its --block-length, ...), naming the
    file and the key."""
    from clover_jax.serving.requests import BadRequest, Request

    settings = {k: v for k, v in defaults.items() if k != "max_tokens"}
    if not defaults:
        return
    spell = {k: f"{where}: {k}" for k in settings}
    request = Request((0,), min(defaults.get("max_tokens", 1), engine.max_tokens), SamplerConfig(**settings))
    try:
        request.check(engine.block_length, engine.cache, engine.cfg.vocab_size, 1, engine.max_tokens, spell)
    except BadRequest as e:
        raise UsageError(str(e)) from None


def engine_kwargs(args: argparse.Namespace, mesh: Any) -> dict[str, Any]:
    """Engine(...) keyword arguments of the flags; limits not given are left to the engine's defaults."""
    kwargs: dict[str, Any] = {"batch_sizes": tuple(sorted(set(args.batch_sizes))), "cache": args.cache,
                              "queue_size": args.queue_size, "dispatch": args.dispatch, "mesh": mesh,
                              "self_speculative": args.self_speculative, "prefill_rows": args.prefill_rows,
                              "prefix_cache_gb": args.prefix_cache_gb,
                              "scaffold_classes": SCAFFOLD_CLASSES if args.tool_calls == "scaffold" else 0}
    given = {k: getattr(args, k) for k in ("block_length", "max_prompt", "max_tokens")}
    return kwargs | {k: v for k, v in given.items() if v is not None}


def run(args: argparse.Namespace) -> int:
    """Check the flags, reserve the port, load and compile, then serve until a signal has drained it."""
    check_flags(args)
    check_installed()
    _LOG["format"] = args.log_format
    keys = api_keys(args)
    warning = exposure_warning(args.host, keys)
    if warning:
        _say(warning, "warning")
    sock = bind(args.host, args.port)  # a busy port fails now, not after minutes of compiling
    try:
        model = args.model or loading.default_model()
        stored = loading.sampler_defaults(model)
        cfg, weights, tok, mesh = loading.open_model(model, args.mesh, _say_loading)
        cfg = with_memory_flags(cfg, args)
        from clover_jax.serving.engine import Engine
        from clover_jax.serving.http_request import request_defaults

        if args.block_length is None:
            args.block_length = stored.get("block_length", SamplerConfig.block_length)
        defaults = request_defaults(stored)
        if defaults:
            _say("request defaults from the checkpoint's generation_config.json: "
                 + ", ".join(f"{k} {v}" for k, v in defaults.items()))
        engine = Engine(weights, cfg, **engine_kwargs(args, mesh))
        if engine.admission.prefix_cache_note:
            _say(f"the prefix cache is off: {engine.admission.prefix_cache_note}", "warning")
        elif engine.admission.prefix_cache:
            _say(f"prefix cache: {args.prefix_cache_gb:g} GB, {engine.admission.row_bytes / 1e6:.1f} MB a saved prompt")
        check_defaults(defaults, engine, os.path.join(model, "generation_config.json"))
        engine.warm_up(_compiled)
        engine.start()
        return _serve(engine, tok, cfg.name, sock, args.log_level, defaults, limits=limits(args), api_keys=keys,
                      log_format=args.log_format)
    finally:
        sock.close()


def _say_loading(line: str) -> None:
    """`loading.open_model`'s lines as this server's log lines (its warnings at level warning)."""
    warning = line.startswith("warning: ")
    _say(line.removeprefix("warning: "), "warning" if warning else "info")


class Drainer:
    """The one drain of a server: mark the app draining (new requests get 503), let the engine finish what
    it holds in a thread (the event loop keeps streaming meanwhile), then tell uvicorn to exit, which
    waits for the responses still being sent."""

    def __init__(self, app: Any, engine: Any) -> None:
        self.app, self.engine = app, engine
        self.thread: threading.Thread | None = None
        self.forced = False

    def on_signal(self, server: Any) -> None:
        """uvicorn's signal handler: the first signal drains, a second one exits at once."""
        if self.thread is not None:
            _say("second signal: exiting without waiting for the requests in flight")
            self.forced = server.force_exit = server.should_exit = True
            return
        _say("draining: finishing the requests in flight (signal again to exit at once)")
        self.start(server)

    def start(self, server: Any | None) -> None:
        """Begin the drain; uvicorn (`server`, if any) is told to exit once the engine is done."""
        from clover_jax.serving.api import set_draining

        set_draining(self.app)
        self.thread = threading.Thread(target=self._drain, args=(server,), name="clover-drain", daemon=True)
        self.thread.start()

    def _drain(self, server: Any | None) -> None:
        try:
            self.engine.drain()
        except Exception as e:  # still let uvicorn exit
            _say(f"error while draining: {e!r}")
        finally:
            if server is not None:
                server.should_exit = True

    def finish(self) -> None:
        """After uvicorn returned: drain now if no signal did (uvicorn stopped for another reason), and wait
        for it unless a second signal forced the exit."""
        if self.thread is None:
            self.start(None)
        if not self.forced and self.thread is not None:
            self.thread.join()


def _serve(engine: Any, tok: Any, model_name: str, sock: socket.socket, log_level: str,
           defaults: dict[str, Any] | None = None, *, limits: Any = None, api_keys: list[str] | None = None,
           log_format: str = "text") -> int:
    import uvicorn
    from sse_starlette.sse import AppStatus

    from clover_jax.serving.api import make_app
    from clover_jax.serving.logs import uvicorn_log_config

    # sse-starlette would cut every open stream as soon as uvicorn begins to exit; the drain lets them end.
    AppStatus.disable_automatic_graceful_drain()
    app = make_app(engine, tok, model_name, log=lambda m: _say(m, "error"), defaults=defaults, limits=limits,
                   api_keys=api_keys or ())
    drainer = Drainer(app, engine)
    address = url(sock)

    class DrainingServer(uvicorn.Server):
        """uvicorn, with SIGTERM/SIGINT starting a drain instead of shutting down at once."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            drainer.on_signal(self)

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                _say(f"listening on {address}")

    # uvicorn's own access log is off: Guard writes one access line per request instead (never a header)
    config = uvicorn.Config(app, log_level=log_level, lifespan="off", timeout_graceful_shutdown=GRACEFUL_S,
                            log_config=uvicorn_log_config(log_format, log_level), access_log=False,
                            server_header=False)
    server = DrainingServer(config)
    try:
        server.run(sockets=[sock])
    finally:
        drainer.finish()
    _say("exited without draining" if drainer.forced else "drained, exiting")
    return 0
