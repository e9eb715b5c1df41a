"""Serving: `clover serve`'s batching engine and its OpenAI-compatible HTTP face.

`requests` (what a client asks for, what it gets back, the errors), `program` (the compiled
per-block programs over rows that each run their own request), `engine` (the queue and the
scheduler thread), `api` / `chat` / `metrics` (the HTTP layer, which needs the `serve` extra).
Nothing here is imported by the model or the sampler.
"""
