"""uvicorn with a shutdown deadline: `sparrow serve --shutdown-timeout S`.

On SIGTERM or SIGINT (Ctrl-C) the scheduler drains at once (`Scheduler.drain`): new requests and those waiting
in the queue get HTTP 503 (`shutting_down`), `/health` answers 503, and running requests go on until S seconds
after the signal, then end with a last chunk (streamed) or a whole response, finish reason "length" and
`sparrow.ended_by` "shutdown" (at their last round that ends before the deadline; a round that overruns it is
not waited for: the HTTP layer answers with the text so far, `app.HANDLER_GRACE_SECONDS` after the deadline).
Once no request is in flight (at the latest GRACE_SECONDS after the deadline), uvicorn's own shutdown closes the
sockets and connections (cancelling a handler still open after GRACE_SECONDS more), the scheduler's worker gets
until half a second past the deadline to stop, and the process exits. A second Ctrl-C exits at once, as in
uvicorn.
"""

from __future__ import annotations

import asyncio
import socket
import time
from types import FrameType

import uvicorn

from sparrow.serve.scheduler import Scheduler

GRACE_SECONDS = 0.4  # past the deadline: for a round that overruns it, then for the last bytes to go out
POLL_SECONDS = 0.02


class DeadlineServer(uvicorn.Server):
    """A uvicorn server that drains `scheduler` within `shutdown_timeout` seconds of the exit signal."""

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler, shutdown_timeout: float) -> None:
        config.timeout_graceful_shutdown = GRACE_SECONDS  # then uvicorn cancels what is still open
        super().__init__(config)
        self.scheduler, self.shutdown_timeout = scheduler, shutdown_timeout
        self.signalled: float | None = None  # perf_counter() of the first exit signal

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.signalled is None:
            self.signalled = time.perf_counter()
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        now = time.perf_counter()
        deadline = (self.signalled if self.signalled is not None else now) + self.shutdown_timeout
        self.scheduler.drain(deadline - now)
        while self.server_state.tasks and time.perf_counter() < deadline + GRACE_SECONDS and not self.force_exit:
            await asyncio.sleep(POLL_SECONDS)
        await super().shutdown(sockets)
