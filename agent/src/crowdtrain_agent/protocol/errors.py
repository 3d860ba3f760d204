"""The one exception type for anything a peer sent that breaks the protocol."""

from __future__ import annotations

from .frames import CloseCode


class ProtocolError(ValueError):
    """A message, frame or ticket that a peer must not have sent.

    ``close_code`` tells the receiving side which WebSocket close code to use
    when the error is fatal for the connection; ``fatal=False`` errors are
    answered with an ``error`` message and the connection stays open.
    """

    def __init__(self, message: str, *, close_code: int = CloseCode.BAD_MESSAGE, fatal: bool = False) -> None:
        super().__init__(message)
        self.close_code = int(close_code)
        self.fatal = fatal
