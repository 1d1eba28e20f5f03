"""The errors a serving request can meet before it runs; the server maps them to HTTP statuses."""

from __future__ import annotations


class BadRequest(ValueError):
    """A request the engine refuses as given (HTTP 400): ``field`` names what was wrong, ``message`` says what to do."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class QueueFull(RuntimeError):
    """The engine cannot take the request now (HTTP 429): the waiting queue is full or the token rate is spent."""
