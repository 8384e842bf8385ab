"""The one exception a bad request becomes: the HTTP layer answers it as a 4xx JSON error."""

from __future__ import annotations


class APIError(Exception):
    """An HTTP status and one sentence; `type` (the API's error kind), `param` (the request
    field at fault) and `code` by name only, so none can land in another's place."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type, param, code
        )  # fmt: skip

    def body(self, anthropic: bool = False) -> dict:
        if anthropic:
            return {"type": "error", "error": {"type": self.type, "message": self.message}}
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }
