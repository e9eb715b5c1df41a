"""The HTTP layer's error: an OpenAI error object with a status code.

Every refusal of `clover serve` is answered as {"error": {"message", "type", "param", "code"}}; the
request parser, the response renderer and the routes all raise `ApiError`, and the routes answer it.
"""

from __future__ import annotations

from starlette.responses import JSONResponse

CLIENT_CLOSED = 499  # the access log's status of a request whose client hung up mid-body (nginx's convention)


class ApiError(Exception):
    """An error answered as an OpenAI error object with HTTP status `status`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        """The JSON error response."""
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)
