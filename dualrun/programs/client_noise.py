"""The router's trouble with its clients, as one line per kind (dualrun/light/noise.py).

Why apart from the router: aiohttp reports each request it could not read, each client gone mid-answer and each
handler's error as a logged traceback ("Error handling request", logger `aiohttp.server`); this routes those records
to a `Noise` reporter instead. aiohttp is imported where a record is handled: the router has it loaded by then.
"""
from __future__ import annotations

import logging

from aiohttp.http_exceptions import HttpProcessingError

from dualrun.light.noise import DROPPED, DROPPED_ERRORS, FAILED, MALFORMED, Noise


class ClientTrouble(logging.Handler):
    """aiohttp's "Error handling request" records (a malformed request, a client gone mid-answer, a handler's
    error), one line per kind (dualrun/light/noise.py) instead of a traceback each."""

    def __init__(self, noise: Noise) -> None:
        super().__init__(logging.ERROR)
        self.noise = noise

    def emit(self, record: logging.LogRecord) -> None:
        error = record.exc_info[1] if record.exc_info else None
        if error is None:
            self.noise.report(FAILED, record.getMessage()[:80])
            return
        what = MALFORMED if isinstance(error, HttpProcessingError) else (
            DROPPED if isinstance(error, DROPPED_ERRORS) else FAILED)
        self.noise.report(what, error, record.getMessage())


def quiet_client_trouble(noise: Noise) -> None:
    """Route aiohttp's per-request error records to `noise` (and nowhere else)."""
    logger = logging.getLogger("aiohttp.server")
    logger.addHandler(ClientTrouble(noise))
    logger.propagate = False
