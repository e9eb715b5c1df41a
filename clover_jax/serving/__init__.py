"""Serving: `clover serve`'s batching engine and its OpenAI-compatible HTTP face.

`requests` (what a client asks for, what it gets back, the errors), `program` (the compiled
per-block programs over rows that each run their own request), `admission` (queued requests into
rows: prefill widths, batched prefill, the prefix cache of `prefix_cache`), `stats` (the counters)
and `engine` (the queue and the scheduler thread).

The HTTP layer (which needs the `serve` extra): `api` (the routes and `make_app`), `http_request`
(a request body's fields and limits, parsed into a `Job`), `choices` (a Job's choices in the engine:
released text, stop strings, tool calls, the deadline), `responses` (JSON and SSE rendering),
`http_errors` (`ApiError`, the OpenAI error object), `guard` (API keys, body limit, request ids,
access lines), `logs`, `metrics`, `schema` (the OpenAPI document) and `background` (the app on a
loopback port in a thread).

Plain Python, usable without the extra: `chat` (messages to prompt text), `tools` (the tool fields),
`tool_parse` (tool calls in a model's text) and `field_error` (`FieldError`, the error of `chat`
and `tools`). Nothing here is imported by the model or the sampler.
"""
