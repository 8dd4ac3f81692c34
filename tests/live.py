"""A live uvicorn server on a free 127.0.0.1 port in a thread, for the tests that talk HTTP to one."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import uvicorn
from fastapi import FastAPI


@contextlib.contextmanager
def serving(app: FastAPI, seconds: float = 60) -> Iterator[str]:
    """Yields the base URL once `/health` answers 200 (the model is loaded); stops the server afterwards."""
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + seconds
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.05)
        yield url
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
