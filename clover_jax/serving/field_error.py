"""The one error of the chat request parsers (`clover_jax.serving.chat`, `clover_jax.serving.tools`).

Those parsers run without the `serve` extra (the toy agent uses them too), so their error is a plain
`ValueError` carrying the offending field's name; the HTTP layer turns it into a 400 with that `param`.
"""

from __future__ import annotations


class FieldError(ValueError):
    """A malformed field of a chat request (`messages`, `tools`, `tool_choice`, ...); `param` names the field
    as OpenAI's error object does (e.g. "messages[0].role", "tools[0].function.name")."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param
