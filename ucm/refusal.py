"""`Refused`: a request the daemon will not serve, with the error code its reply carries."""

from __future__ import annotations

from ucm.store_wire import ErrorCode


class Refused(ValueError):
    """Bad input from a client (never a daemon bug): answered with an `ErrorReply(code, message)`."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
