"""An answer a side-channel handler gives later, from another thread (`Later`)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvbridge.wire import messages as wire

__all__ = ["Later"]


class Later:
    """An answer given later: a handler returns one when it cannot answer yet (a claim of a request whose hold has
    not come), and whoever learns the answer calls `give` from any thread; the server's thread sends it at once.
    The handler's owner answers every Later it made within the time the client waits (a bounded number of them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sink: Callable[[wire.Message], None] | None = None
        self._answer: wire.Message | None = None

    def give(self, message: wire.Message) -> None:
        """Answer now (the first answer counts; later ones are ignored)."""
        with self._lock:
            if self._answer is not None:
                return
            self._answer, sink = message, self._sink
        if sink is not None:
            sink(message)

    def bind(self, sink: Callable[[wire.Message], None]) -> None:
        """Where the answer goes (the server, once it knows the envelope); an answer given already goes now."""
        with self._lock:
            self._sink, answer = sink, self._answer
        if answer is not None:
            sink(answer)
