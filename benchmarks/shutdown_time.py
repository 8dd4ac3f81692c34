"""How long `sparrow serve` takes to shut down on SIGTERM while streams run and others wait.

    python benchmarks/shutdown_time.py --target smollm2-135m --streams 16 --max-batch 8 --shutdown-timeout 10

Starts `python -m sparrow.cli serve` (the sparrow on PYTHONPATH), sends `--streams` streamed chat completions of
`--max-tokens` tokens, waits until `--max-batch` of them run and the rest wait in the queue, sends SIGTERM, and
prints one JSON line: seconds from the signal to the process' exit, and per request its HTTP status, the seconds
from the signal to its end, its finish reason and whether the stream was whole (a last chunk, then [DONE]).
`--shutdown-timeout` is left out when not given (a sparrow without the flag).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def gauge(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def stream(url: str, body: dict, record: dict) -> None:
    """One streamed completion; fills `record` with status, end time, finish reason, wholeness."""
    finish, done = None, False
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as answer:
            record["status"] = answer.status_code
            for line in answer.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    data = json.loads(line[6:])
                    for choice in data.get("choices", ()):
                        finish = choice.get("finish_reason") or finish
    except httpx.HTTPError as e:
        record["error"] = type(e).__name__
    record.update(ended=time.monotonic(), finish_reason=finish, whole=done)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--drafter", default="prompt-lookup")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--shutdown-timeout", type=float, default=None)
    p.add_argument("--sparrow-args", default="", help="more `sparrow serve` flags, e.g. '--dtype float32'")
    args = p.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "sparrow.cli", "serve", "--target", args.target, "--drafter", args.drafter,
            "--port", str(port), "--max-batch", str(args.max_batch), "--max-queue", str(args.streams)]
    argv += shlex.split(args.sparrow_args)
    if args.shutdown_timeout is not None:
        argv += ["--shutdown-timeout", str(args.shutdown_timeout)]
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                sys.exit(f"the server exited with code {server.returncode}")
            time.sleep(0.5)
        question = "Write a very long, detailed story about a lighthouse keeper, at least 2000 words."
        body = {"messages": [{"role": "user", "content": question}], "max_tokens": args.max_tokens,
                "temperature": 0, "stream": True}
        records = [{} for _ in range(args.streams)]
        threads = [threading.Thread(target=stream, args=(url, body, r)) for r in records]
        for thread in threads:
            thread.start()
            time.sleep(0.05)
        waiting = args.streams - args.max_batch
        while gauge(url, "sparrow:num_requests_running") < args.max_batch or \
                gauge(url, "sparrow:num_requests_waiting") < waiting:
            time.sleep(0.1)
        time.sleep(1.0)  # the running ones are streaming
        signalled = time.monotonic()
        server.send_signal(signal.SIGTERM)
        server.wait(600)
        exited = time.monotonic() - signalled
        for thread in threads:
            thread.join(60)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
    rows = [{"status": r.get("status"), "error": r.get("error"), "seconds": round(r["ended"] - signalled, 2),
             "finish_reason": r.get("finish_reason"), "whole": r.get("whole")} for r in records]
    print(json.dumps({"exit_seconds": round(exited, 2), "shutdown_timeout": args.shutdown_timeout,
                      "target": args.target, "streams": args.streams, "max_batch": args.max_batch,
                      "cpu_count": os.cpu_count(), "requests": rows}))


if __name__ == "__main__":
    main()
