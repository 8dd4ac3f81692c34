"""Bounded load test of `sparrow serve` on loopback, against the same server without drafting and `transformers serve`.

For each configuration the script starts the server as a subprocess on 127.0.0.1 (a free port; its stdout and stderr
go to `OUT/load_test_logs/`), waits for `GET /health` to answer 200 and sends a warm-up request. Then, for each
concurrency `c`, each configuration in turn sends `--requests N` streamed chat requests (greedy, `max_tokens`,
prompts cycled from `benchmarks/prompts.json` or Spec-Bench's first turns) with the official `openai` async client,
at most `c` in flight (closed loop: a slot is refilled as soon as its request ends). Every request ends as ok or
with its error text (HTTP status and message, a broken stream, a client-side timeout): nothing is lost, and for
sparrow the server's own `/metrics` request count is checked against the client's. With `--rounds R` (default 2)
every server is up at once (an idle one takes no CPU) and each level runs R times, the configurations taking turns
in alternating order (speculative, plain, plain, speculative, ...), so a machine whose speed drifts over minutes (as
shared ones do) weighs on both sides alike; `--rounds 1` runs one server at a time, every level, then the next. The
servers are killed at the end, also on an error, Ctrl-C or SIGTERM.

One JSONL row per (configuration, concurrency, round) is appended to `OUT/load_test.jsonl` (one per request to
`OUT/load_test_requests.jsonl`): requests/s, aggregate output tokens/s (from `usage.completion_tokens`),
p50/p99 end-to-end latency and time to first content chunk, failures, mean accepted tokens per target forward
(sparrow's `usage.speculative`), the server's RSS before, at peak during and after the level, the CPU, thread
count, sparrow commit and date. A configuration that cannot run (e.g. `transformers serve` missing a package)
gets one row saying why. `OUT/load_test.md` (and `OUT/load_test.png` with matplotlib) is rendered from the
newest run of each configuration in the JSONL: a level's rounds as their median and range, and each configuration's
output tokens/s as a multiple of `plain`'s at the same level (its median and, in brackets, the range of the ratios
within each round).

Configurations (`--configs`): `speculative` (`sparrow serve` with `--drafter/--draft/--draft-quant`), `plain` (the
same target, `--drafter none`), `speculative-prefix-cache` and `plain-prefix-cache` (the same with `--prefix-cache
TOKENS`, from this script's `--prefix-cache`), `transformers-serve` (`transformers serve`, shipped with
transformers, pinned to the preset's safetensors cache directory `$SPARROW_CACHE/models/<preset>-<dtype>` with
HF_HUB_OFFLINE=1) and the opt-in `transformers-serve-cb` (the same with `--continuous-batching`). `--sparrow-args` /
`--transformers-args` pass extra server options (e.g. `--sparrow-args "--max-batch 8"`). `--timeout` bounds each
request, time spent queued on the server included; `--load-timeout` bounds a server's start.

Reproduce the README numbers (2-core CPU, bfloat16; the sparrow runs fill the safetensors cache that
`transformers serve` then loads):

    .venv/bin/python benchmarks/load_test.py --configs speculative,plain,transformers-serve \\
        --target qwen2.5-coder-1.5b --drafter draft-model --draft qwen2.5-coder-0.5b --draft-quant int4 \\
        --concurrency 1,4,8,32 --requests 32 --max-tokens 64 --out benchmarks/results

Conversations (`--turns T`): each of a level's requests becomes a conversation of T requests, each sending the
conversation so far (the first prompt, every answer, a follow-up from FOLLOW_UPS); the table's notes then give the
TTFT p50 of the turns after the first and how many prompt tokens the prefix cache served
(`usage.prompt_tokens_details`):

    .venv/bin/python benchmarks/load_test.py --configs plain,plain-prefix-cache --turns 4 --concurrency 1,4 \
        --requests 4 --max-tokens 32 --out /tmp/turns

Smoke run on a small preset (prompt lookup needs no draft model):

    .venv/bin/python benchmarks/load_test.py --target smollm2-135m --drafter prompt-lookup \\
        --concurrency 1,4 --requests 8 --max-tokens 32 --out /tmp/loadtest

Re-render the table and plot from the JSONL only:  `.venv/bin/python benchmarks/load_test.py --render --out DIR`
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CONFIG_NAMES = ("speculative", "plain", "speculative-prefix-cache", "plain-prefix-cache", "transformers-serve",
                "transformers-serve-cb")
DEFAULT_CONFIGS = "speculative,plain,transformers-serve"
JSONL, REQUESTS_JSONL, MARKDOWN, PLOT, LOGS = ("load_test.jsonl", "load_test_requests.jsonl", "load_test.md",
                                               "load_test.png", "load_test_logs")
MiB = 1024 * 1024
FOLLOW_UPS = ("Go on.", "Now say it again in fewer words.", "Give one example.", "What would you check first?")
"""The user's next messages in a conversation of `--turns` > 1 (after the first prompt and each answer)."""


# ---------------------------------------------------------------- pure parts: statistics, rows, rendering


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default); None if
    there are no values. With few requests p99 is close to the maximum."""
    if not values:
        return None
    xs = sorted(values)
    rank = (len(xs) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return xs[low] + (xs[high] - xs[low]) * (rank - low)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(results: list[dict], wall_seconds: float) -> dict[str, Any]:
    """A (configuration, concurrency) level's statistics from its per-request records (`ok`, `error`,
    `latency_s`, `ttft_s`, `output_tokens`, `finish_reason`, `speculative`). Throughputs count successful
    requests only, over the level's wall time."""
    ok = [r for r in results if r["ok"]]
    failed = [r for r in results if not r["ok"]]
    latencies = [r["latency_s"] for r in ok]
    ttfts = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None]
    tokens = [r["output_tokens"] for r in ok if r.get("output_tokens") is not None]
    spec = [r["speculative"] for r in ok if r.get("speculative")]
    accepted = [s["mean_accepted_tokens"] for s in spec if s.get("mean_accepted_tokens") is not None]
    drafted = sum(s.get("num_draft_tokens") or 0 for s in spec)
    errors = Counter(r["error"] for r in failed)
    return {
        "requests": len(results),
        "ok": len(ok),
        "failed": len(failed),
        "errors": [{"error": e, "count": n} for e, n in errors.most_common(5)],
        "wall_seconds": wall_seconds,
        "requests_per_second": len(ok) / wall_seconds if wall_seconds > 0 else None,
        "output_tokens": sum(tokens),
        "requests_without_usage": len(ok) - len(tokens),
        "output_tokens_per_second": sum(tokens) / wall_seconds if wall_seconds > 0 and tokens else None,
        "latency_p50_s": percentile(latencies, 50),
        "latency_p99_s": percentile(latencies, 99),
        "latency_mean_s": _mean(latencies),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "finish_reasons": dict(Counter(r.get("finish_reason") for r in ok)),
        "mean_accepted_tokens": _mean(accepted),  # mean over requests of tokens per target forward
        "ttft_follow_up_p50_s": percentile([r["ttft_s"] for r in ok if r.get("turn") and r.get("ttft_s") is not None],
                                           50),  # turns after a conversation's first (`--turns`)
        "cached_prompt_tokens": sum(r.get("cached_tokens") or 0 for r in ok),
        "prompt_tokens": sum(r.get("prompt_tokens") or 0 for r in ok),
        "acceptance_rate": sum(s.get("num_accepted_tokens") or 0 for s in spec) / drafted if drafted else None,
    }


def latest_rows(rows: list[dict]) -> list[dict]:
    """For each configuration, the rows of the newest run that has it (re-running one configuration replaces its
    rows in the rendered table); configurations in first-seen order, levels by concurrency."""
    newest: dict[str, str] = {}
    for r in rows:
        newest[r["config"]] = max(newest.get(r["config"], ""), r["run"])
    order = list(dict.fromkeys(r["config"] for r in rows))
    keep = [r for r in rows if r["run"] == newest[r["config"]]]
    return sorted(keep, key=lambda r: (order.index(r["config"]), r.get("concurrency") or 0))


MEDIAN_KEYS = ("requests_per_second", "output_tokens_per_second", "latency_p50_s", "latency_p99_s", "ttft_p50_s",
               "ttft_p99_s", "mean_accepted_tokens", "wall_seconds", "ttft_follow_up_p50_s")


def merge_rounds(rows: list[dict]) -> list[dict]:
    """One row per (configuration, concurrency) of `latest_rows(rows)`: a level measured in several rounds becomes
    its rounds' medians (MEDIAN_KEYS), summed counts and errors, the first round's RSS before and the last's after,
    with `round_tok_s` (output tok/s by round) and `level_rounds`; plus `x_plain` (the median tok/s over the plain
    configuration's at that level) and `x_plain_rounds` (the same ratio within each round) where `plain` ran."""
    groups: dict[tuple[str, int | None], list[dict]] = {}
    for r in latest_rows(rows):
        key = (r["config"], r.get("concurrency"))
        groups.setdefault(key if key[1] is not None else (key[0], id(r)), []).append(r)
    merged = []
    for group in groups.values():
        group = sorted(group, key=lambda r: r.get("round") or 0)
        first, last = group[0], group[-1]
        if first.get("concurrency") is None:
            merged.append(first)
            continue
        row = {**first, "level_rounds": len(group), "round_tok_s": [r.get("output_tokens_per_second") for r in group]}
        for key in MEDIAN_KEYS:
            values = [r[key] for r in group if r.get(key) is not None]
            row[key] = statistics.median(values) if values else None
        for key in ("requests", "ok", "failed", "cached_prompt_tokens", "prompt_tokens"):
            row[key] = sum(r.get(key) or 0 for r in group)
        errors = Counter()
        for r in group:
            errors.update({e["error"]: e["count"] for e in r.get("errors") or []})
        row["errors"] = [{"error": e, "count": n} for e, n in errors.most_common(5)]
        row["server_seen_mismatch"] = "; ".join(r["server_seen_mismatch"] for r in group
                                                if r.get("server_seen_mismatch")) or None
        row["rss_mib_after"] = last.get("rss_mib_after")
        row["rss_mib_peak"] = max((r.get("rss_mib_peak") or 0.0 for r in group), default=None)
        merged.append(row)
    plain = {r["concurrency"]: r for r in merged if r["config"] == "plain" and r.get("concurrency") is not None}
    for row in merged:
        base = plain.get(row.get("concurrency"))
        if base is None or row is base or row["run"] != base["run"]:
            continue
        row["x_plain"] = _ratio(row["output_tokens_per_second"], base["output_tokens_per_second"])
        row["x_plain_rounds"] = [_ratio(a, b) for a, b in zip(row["round_tok_s"], base["round_tok_s"])]
    return merged


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _spread(values: list[float | None] | None, fmt: str = ".2f") -> str:
    """' (min–max)' of several values, '' for fewer than two."""
    values = [v for v in values or [] if v is not None]
    return f" ({min(values):{fmt}}–{max(values):{fmt}})" if len(values) > 1 else ""


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "–" if x is None else format(x, fmt)


def _pair(a: float | None, b: float | None, fmt: str = ".2f") -> str:
    return f"{_num(a, fmt)} / {_num(b, fmt)}"


def _mib(x: float | None) -> str:
    return _num(x, ".0f")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def render_markdown(rows: list[dict]) -> str:
    """The Markdown report of `latest_rows(rows)`: one table row per (configuration, concurrency), a line per
    configuration that did not run, the error texts, then the settings the numbers were taken with."""
    rows = merge_rounds(rows)
    lines = ["| config | streams | ok / failed | req/s | out tok/s | × plain | latency p50 / p99 (s) "
             "| TTFT p50 / p99 (s) | tok/step | server RSS MiB: before → after (peak) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    notes = []
    for r in rows:
        if r.get("concurrency") is None:  # the configuration did not run
            lines.append(f"| {r['config']} | – | – | – | – | – | – | – | – | did not run (see below) |")
            notes.append(f"- **{r['config']}** did not run: {_one_line(r['error'])}")
            continue
        lines.append(
            f"| {r['config']} | {r['concurrency']} | {r['ok']} / {r['failed']} "
            f"| {_num(r['requests_per_second'], '.3f')} "
            f"| {_num(r['output_tokens_per_second'])}{_spread(r.get('round_tok_s'))} "
            f"| {_num(r.get('x_plain'))}{_spread(r.get('x_plain_rounds'))} "
            f"| {_pair(r['latency_p50_s'], r['latency_p99_s'])} "
            f"| {_pair(r['ttft_p50_s'], r['ttft_p99_s'])} | {_num(r['mean_accepted_tokens'])} "
            f"| {_mib(r.get('rss_mib_before'))} → {_mib(r.get('rss_mib_after'))} ({_mib(r.get('rss_mib_peak'))}) |")
        for e in r.get("errors") or []:
            notes.append(f"- {r['config']}, {r['concurrency']} streams: {e['count']}× {_one_line(e['error'])}")
        if r.get("ttft_follow_up_p50_s") is not None:  # conversations (--turns)
            notes.append(f"- {r['config']}, {r['concurrency']} streams: TTFT p50 of the turns after the first "
                         f"{_num(r['ttft_follow_up_p50_s'])} s; {r.get('cached_prompt_tokens') or 0} of "
                         f"{r.get('prompt_tokens') or 0} prompt tokens taken from the prefix cache")
        lost = r.get("server_seen_mismatch")
        if lost:
            notes.append(f"- {r['config']}, {r['concurrency']} streams: {lost}")
    out = ["\n".join(lines)]
    if notes:
        out.append("\n".join(notes))
    settings = []
    for run in dict.fromkeys(r["run"] for r in rows):
        r = next(x for x in rows if x["run"] == run)
        configs = ", ".join(dict.fromkeys(x["config"] for x in rows if x["run"] == run))
        settings.append(
            f"- run {run} ({configs}): target `{r['target']}`, {r['requests_per_level']} "
            f"{'conversations of %d turns' % r['turns'] if (r.get('turns') or 1) > 1 else 'requests'} per level"
            f"{_rounds(max(x.get('level_rounds', 1) for x in rows if x['run'] == run))}, "
            f"`max_tokens` {r['max_tokens']}, temperature 0, prompts `{r['prompts']}`; {r['cpu']} "
            f"({', '.join(r.get('cpu_features') or []) or 'no AVX2 or AVX-512'}), "
            f"{r['cpus']} CPUs, {r['torch_threads']} torch threads; sparrow {r['commit'][:12]}"
            f"{' (dirty)' if r.get('dirty') else ''}, transformers {r.get('transformers_version')}")
    out.append("\n".join(settings))
    commands = [f"- {r['config']}: `{r['server_cmd']}`" for r in rows
                if r.get("server_cmd") and r is next(x for x in rows if x["config"] == r["config"])]
    if commands:
        out.append("Servers:\n" + "\n".join(commands))
    return "\n\n".join(out) + "\n"


def _rounds(n: int) -> str:
    return (f" in {n} rounds (the servers up together, taking turns in alternating order; figures are the rounds' "
            "medians, (min–max) their range, × plain the ratio to plain's median and, in brackets, within each round)"
            if n > 1 else "")


def render_plot(rows: list[dict], path: Path) -> bool:
    """Output tokens/s and p50 latency against concurrency, a line per configuration; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in merge_rounds(rows) if r.get("concurrency") is not None]
    if not rows:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for config in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == config]
        xs = [r["concurrency"] for r in mine]
        left.plot(xs, [r["output_tokens_per_second"] or 0 for r in mine], marker="o", label=config)
        right.plot(xs, [r["latency_p50_s"] or 0 for r in mine], marker="o", label=config)
    levels = sorted({r["concurrency"] for r in rows})
    for ax, title in ((left, "output tokens/s (all streams)"), (right, "p50 end-to-end latency (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent streams")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    left.legend()
    r = rows[0]
    fig.suptitle(f"{r['target']}, max_tokens {r['max_tokens']}, {r['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def read_rows(path: Path) -> list[dict]:
    """The rows of `path`, or of `path`.gz (benchmarks/results keeps rows gzipped); none if neither exists."""
    from sparrow.bench.report import read_jsonl

    return [json.loads(line) for line in read_jsonl(path) if line.strip()]


def render(out: Path) -> str:
    """Write OUT/load_test.md (and .png) from OUT/load_test.jsonl; returns the Markdown."""
    rows = read_rows(out / JSONL)
    if not rows:
        return ""
    text = render_markdown(rows)
    (out / MARKDOWN).write_text(text)
    render_plot(rows, out / PLOT)
    return text


def parse_prometheus(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(metric name, sorted label pairs): value} of a Prometheus text exposition."""
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([^\s{]+)(?:\{(.*)\})?\s+(\S+)", line)
        if not m:
            continue
        labels = tuple(sorted(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or "")))
        with contextlib.suppress(ValueError):
            samples[(m.group(1), labels)] = float(m.group(3))
    return samples


def server_counts(before: dict, after: dict, endpoint: str = "/v1/chat/completions") -> dict[str, Any]:
    """What sparrow's /metrics saw between two scrapes: requests to `endpoint` by status, generated tokens."""
    statuses: dict[str, int] = {}
    for (name, labels), value in after.items():
        if name == "sparrow:requests_total" and dict(labels).get("endpoint") == endpoint:
            delta = int(value - before.get((name, labels), 0.0))
            if delta:
                statuses[dict(labels).get("status", "?")] = delta
    generated = ("sparrow:generation_tokens_total", ())
    tokens = after.get(generated, 0.0) - before.get(generated, 0.0)
    return {"server_requests": statuses, "server_generation_tokens": int(tokens)}


# ---------------------------------------------------------------- the machine and the code under test


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    import platform

    return platform.processor() or platform.machine()


def cpu_features(wanted: tuple[str, ...] = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")) -> list[str]:
    """Which of the CPU flags that matter for bfloat16 matmuls /proc/cpuinfo lists."""
    with contextlib.suppress(OSError, StopIteration):
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
        return [f for f in wanted if f in flags]
    return []


def torch_threads() -> int | None:
    """The intra-op threads a server started from this environment uses (torch's default honours OMP_NUM_THREADS)."""
    with contextlib.suppress(Exception):
        import torch

        return torch.get_num_threads()
    return None


def git_state() -> tuple[str, bool]:
    """The sparrow commit and whether tracked files differ from it (read-only git calls)."""
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                                env=env, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, env=env, timeout=30).stdout.strip()
        return commit or "unknown", bool(dirty)
    except (OSError, subprocess.SubprocessError):
        return "unknown", False


def versions() -> dict[str, str | None]:
    from importlib import metadata

    out = {}
    for package in ("sparrow", "transformers", "torch", "openai"):
        try:
            out[f"{package}_version"] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[f"{package}_version"] = None
    return out


def rss_mib(pid: int) -> float | None:
    """Resident memory of `pid` and its children, MiB (psutil, else /proc/PID/status VmRSS of pid alone)."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        try:
            proc = psutil.Process(pid)
            total = proc.memory_info().rss
            for child in proc.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    total += child.memory_info().rss
            return total / MiB
        except psutil.Error:
            return None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


# ---------------------------------------------------------------- configurations and servers


@dataclass
class ServerConfig:
    name: str
    kind: str  # "sparrow" or "transformers"
    argv: list[str] = field(default_factory=list)  # without --host/--port (added at start)
    model: str = ""  # the model name requests send
    skip: str | None = None  # why it cannot run


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _script(name: str) -> str | None:
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


def sparrow_config(name: str, args: argparse.Namespace, drafting: bool, prefix_cache: int = 0) -> ServerConfig:
    argv = [sys.executable, "-m", "sparrow.cli", "serve", "--target", args.target, "--dtype", args.dtype]
    if drafting:
        from sparrow.drafters.registry import NONE, REGISTRY

        argv += ["--drafter", args.drafter]
        entry = REGISTRY.get(args.drafter)
        if args.drafter != NONE and (entry is None or entry.takes_draft_model):  # unknown: let the server say so
            argv += ["--draft", args.draft]
            if args.draft_quant and args.draft_quant != "none":
                argv += ["--draft-quant", args.draft_quant]
        if args.k is not None:
            argv += ["-k", str(args.k)]
    else:
        argv += ["--drafter", "none"]
    if args.device:
        argv += ["--device", args.device]
    extra = shlex.split(args.sparrow_args or "")
    if "--max-queue" not in extra:  # every stream may wait: a full queue (429) is not what this measures
        argv += ["--max-queue", str(max(32, max(args.concurrency)))]
    if args.api_key:
        argv += ["--api-key", args.api_key]
    if prefix_cache:
        argv += ["--prefix-cache", str(prefix_cache)]
    return ServerConfig(name, "sparrow", argv + extra, model=args.target)


def transformers_model(target: str, dtype: str) -> tuple[str | None, str | None]:
    """What `transformers serve` loads for `target`: a sparrow preset's safetensors cache directory (written by
    any sparrow load of the preset in that dtype), else `target` itself (a local directory or hub id).
    Returns (model, None) or (None, why not)."""
    import torch

    from sparrow.models import cache
    from sparrow.models.loading import _cache_dir_for
    from sparrow.models.presets import get_preset
    from sparrow.paths import default_cache_dir

    try:
        preset = get_preset(target)
    except (ValueError, KeyError):
        return target, None
    entry = _cache_dir_for(preset, getattr(torch, dtype), default_cache_dir())
    state = cache.status(entry).state
    if state != "complete":
        return None, (f"preset {target!r} has no complete {dtype} safetensors cache at {entry} ({state}); a sparrow "
                      f"load writes it (run the speculative or plain configuration first, or `sparrow generate "
                      f"--target {target} --dtype {dtype}`)")
    return str(entry), None


def transformers_config(name: str, args: argparse.Namespace, continuous_batching: bool) -> ServerConfig:
    """Resolved just before it starts: the sparrow configurations before it may have just written the cache."""
    script = _script("transformers")
    if script is None:
        return ServerConfig(name, "transformers", skip="the `transformers` command is not installed")
    model, why = transformers_model(args.target, args.dtype)
    if model is None:
        return ServerConfig(name, "transformers", skip=why)
    argv = [script, "serve", "--dtype", args.dtype, "--log-level", "info"]
    if args.device:
        argv += ["--device", args.device]
    if continuous_batching:
        argv.append("--continuous-batching")
    argv += shlex.split(args.transformers_args or "") + [model]
    return ServerConfig(name, "transformers", argv, model=model)


def make_config(name: str, args: argparse.Namespace) -> ServerConfig:
    if name in ("speculative", "plain", "speculative-prefix-cache", "plain-prefix-cache"):
        return sparrow_config(name, args, drafting=name.startswith("speculative"),
                              prefix_cache=args.prefix_cache if name.endswith("prefix-cache") else 0)
    if name == "transformers-serve":
        return transformers_config(name, args, continuous_batching=False)
    if name == "transformers-serve-cb":
        return transformers_config(name, args, continuous_batching=True)
    raise ValueError(f"unknown configuration {name!r}; expected some of {', '.join(CONFIG_NAMES)}")


class ServerFailed(Exception):
    """The server exited or did not become healthy in time."""


class Server:
    """A server subprocess in its own process group (a terminal's Ctrl-C does not reach it; `stop` ends it and
    anything it started), its output in a log file."""

    def __init__(self, config: ServerConfig, log_path: Path) -> None:
        self.config, self.log_path = config, log_path
        self.port = free_port()
        self.argv = config.argv + ["--host", "127.0.0.1", "--port", str(self.port)]
        self.proc: subprocess.Popen | None = None
        self.log = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> str:
        """The command line, portable: the venv's python as `python`, the port as PORT."""
        script = _script("transformers")
        argv = ["python" if a == sys.executable else "transformers" if a == script else a for a in self.argv]
        return shlex.join(argv).replace(f"--port {self.port}", "--port PORT")

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(self.log_path, "ab")
        self.log.write(f"\n==== {dt.datetime.now(dt.timezone.utc).isoformat()} {shlex.join(self.argv)}\n".encode())
        self.log.flush()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.config.kind == "transformers":
            env.setdefault("HF_HUB_OFFLINE", "1")  # a local directory: no hub round trips (set it to 0 to allow)
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, cwd=REPO, start_new_session=True)

    def log_tail(self, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            text = self.log_path.read_text(errors="replace").strip().splitlines()
            return "\n".join(text[-lines:])
        return ""

    def last_line(self) -> str:
        """The log's last line that is not a bare progress bar, for a one-line error."""
        lines = [line.strip() for line in self.log_tail(40).splitlines() if line.strip()]
        return lines[-1][-300:] if lines else "(empty)"

    def wait_healthy(self, timeout: float) -> float:
        """Seconds until GET /health answered 200; ServerFailed if the process exits or time runs out."""
        import httpx

        start = time.monotonic()
        last = "no answer"
        while time.monotonic() - start < timeout:
            code = self.proc.poll()
            if code is not None:
                raise ServerFailed(f"the server exited with code {code} before /health answered 200 "
                                   f"(log {self.log_path.name}), its last line: {self.last_line()}")
            try:
                response = httpx.get(self.base_url + "/health", timeout=5)
                if response.status_code == 200:
                    return time.monotonic() - start
                last = f"HTTP {response.status_code} {response.text[:200]}"
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}"
            time.sleep(1)
        raise ServerFailed(f"/health did not answer 200 within {timeout:.0f} s (last: {last}; log "
                           f"{self.log_path.name}, its last line: {self.last_line()})")

    def metrics(self) -> dict | None:
        """sparrow's /metrics parsed, None for servers without it."""
        if self.config.kind != "sparrow":
            return None
        import httpx

        try:
            argv = self.config.argv  # /metrics needs the server's --api-key when it has one
            key = argv[argv.index("--api-key") + 1] if "--api-key" in argv[:-1] else None
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            return parse_prometheus(httpx.get(self.base_url + "/metrics", headers=headers, timeout=10).text)
        except httpx.HTTPError:
            return None

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL after 15 s; idempotent."""
        if self.proc is not None and self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, sig)
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self.log is not None:
            self.log.close()
            self.log = None


# ---------------------------------------------------------------- the load


def load_prompts(source: str) -> list[str]:
    """User messages: benchmarks/prompts.json (or another file in its format), or 'spec-bench' for Spec-Bench's
    first turns interleaved across its tasks."""
    if source == "spec-bench":
        from sparrow.bench.data import DEFAULT_DATA, read_questions

        by_task: dict[str, list[str]] = {}
        for q in read_questions(DEFAULT_DATA):
            by_task.setdefault(q.task, []).append(q.turns[0])
        groups = list(by_task.values())
        return [g[i] for i in range(max(map(len, groups))) for g in groups if i < len(g)]
    sys.path.insert(0, str(HERE))
    from common import load_prompts as load_prompt_file

    return [p["prompt"] for p in load_prompt_file(Path(source))]


def describe_error(e: BaseException, timeout: float) -> str:
    import openai

    if isinstance(e, (TimeoutError, asyncio.TimeoutError, openai.APITimeoutError)):
        return f"timeout: no complete answer within {timeout:g} s"
    if isinstance(e, openai.APIStatusError):  # the server's own message: OpenAI's error shape or FastAPI's detail
        body = e.body if isinstance(e.body, dict) else {}
        message = body.get("message") or body.get("detail") or e.message
        return f"HTTP {e.status_code}: {message}"
    return f"{type(e).__name__}: {e}"


async def one_request(client, model: str, messages: list[dict], max_tokens: int, timeout: float) -> dict[str, Any]:
    """One streamed chat request; never raises (its failure is recorded). The record keeps the answer's text
    (`text`) for a conversation's next turn."""
    start = time.perf_counter()
    record: dict[str, Any] = {"ok": False, "error": None, "ttft_s": None, "latency_s": None, "output_tokens": None,
                              "prompt_tokens": None, "cached_tokens": None, "finish_reason": None,
                              "speculative": None, "chunks": 0}
    text: list[str] = []
    try:
        async with asyncio.timeout(timeout):
            stream = await client.chat.completions.create(
                model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                stream=True, stream_options={"include_usage": True})
            async with stream:
                async for chunk in stream:
                    if chunk.usage is not None:  # sparrow: a last chunk without choices; transformers: the last one
                        record["output_tokens"] = chunk.usage.completion_tokens
                        record["prompt_tokens"] = chunk.usage.prompt_tokens
                        record["speculative"] = (chunk.usage.model_extra or {}).get("speculative")
                        details = chunk.usage.prompt_tokens_details
                        record["cached_tokens"] = details.cached_tokens if details is not None else None
                    for choice in chunk.choices:
                        if choice.delta is not None and choice.delta.content:
                            record["chunks"] += 1
                            text.append(choice.delta.content)
                            if record["ttft_s"] is None:
                                record["ttft_s"] = time.perf_counter() - start
                        if choice.finish_reason is not None:
                            record["finish_reason"] = choice.finish_reason
        if record["finish_reason"] is None:
            record["error"] = "the stream ended without a finish_reason"
        else:
            record["ok"] = True
    except Exception as e:  # noqa: BLE001 -- every failure becomes a recorded error (cancellation propagates)
        record["error"] = describe_error(e, timeout)
    record["latency_s"] = time.perf_counter() - start
    record["text"] = "".join(text)
    return record


async def run_level(server: Server, config: ServerConfig, prompts: list[str], concurrency: int, requests: int,
                    max_tokens: int, timeout: float, api_key: str | None,
                    turns: int = 1) -> tuple[list[dict], dict[str, Any]]:
    """`requests` conversations of `turns` requests each (a turn's messages: the conversation so far, then the
    next of FOLLOW_UPS), at most `concurrency` conversations in flight; a record per request (turn) and the level's
    measurements."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=server.base_url + "/v1", api_key=api_key or "none", max_retries=0,
                         timeout=timeout)
    pid = server.proc.pid
    before_metrics = server.metrics()
    measured: dict[str, Any] = {"rss_mib_before": rss_mib(pid)}
    peak = measured["rss_mib_before"] or 0.0
    slots = asyncio.Semaphore(concurrency)

    async def limited(i: int) -> list[dict]:
        async with slots:
            messages, records = [{"role": "user", "content": prompts[i % len(prompts)]}], []
            for turn in range(turns):
                record = await one_request(client, config.model, list(messages), max_tokens, timeout)
                records.append({"index": i, "prompt_index": i % len(prompts), "turn": turn, **record})
                if not record["ok"]:
                    break
                messages += [{"role": "assistant", "content": record["text"]},
                             {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]}]
            return records

    async def sample() -> None:
        nonlocal peak
        while True:
            peak = max(peak, rss_mib(pid) or 0.0)
            await asyncio.sleep(0.5)

    sampler = asyncio.create_task(sample())
    start = time.perf_counter()
    try:
        records = [r for conversation in await asyncio.gather(*(limited(i) for i in range(requests)))
                   for r in conversation]
        wall = time.perf_counter() - start
    finally:
        sampler.cancel()
        await client.close()
    await asyncio.sleep(1.0)  # let the server finish the bookkeeping of the last requests
    measured["rss_mib_after"] = rss_mib(pid)
    measured["rss_mib_peak"] = max(peak, measured["rss_mib_after"] or 0.0)
    measured["wall_seconds"] = wall
    after_metrics = server.metrics()
    if before_metrics is not None and after_metrics is not None:
        counts = server_counts(before_metrics, after_metrics)
        measured.update(counts)
        seen = sum(counts["server_requests"].values())
        if seen != len(records):
            measured["server_seen_mismatch"] = f"the server counted {seen} requests, the client sent {len(records)}"
    measured["server_alive"] = server.proc.poll() is None
    return list(records), measured


# ---------------------------------------------------------------- the run


def append_jsonl(path: Path, row: dict) -> None:
    with open(path, "a") as sink:
        sink.write(json.dumps(row) + "\n")


@dataclass
class Started:
    """A configuration whose server answers: its rows share `base`."""

    name: str
    config: ServerConfig
    server: Server
    base: dict


def start_config(name: str, args: argparse.Namespace, meta: dict, prompts: list[str]) -> Started | None:
    """Build configuration `name`, start its server, wait for /health and send the warm-up requests. None (after
    writing the row that says why) when it does not run; the caller stops a returned server."""
    out: Path = args.out
    base = {**meta, "config": name, "server_kind": None, "server_cmd": None}
    try:
        config = make_config(name, args)
    except Exception as e:  # noqa: BLE001 -- a configuration that cannot be built gets a row
        config = ServerConfig(name, "?", skip=f"{type(e).__name__}: {e}")
    base["server_kind"] = config.kind
    if config.skip:
        print(f"[{name}] does not run: {config.skip}", flush=True)
        append_jsonl(out / JSONL, {**base, "concurrency": None, "error": config.skip})
        return None
    server = Server(config, out / LOGS / f"{name}.log")
    base["server_cmd"] = server.command()
    print(f"[{name}] starting: {server.command()}  (log {server.log_path})", flush=True)
    try:
        server.start()
        base["load_seconds"] = server.wait_healthy(args.load_timeout)
        print(f"[{name}] healthy after {base['load_seconds']:.1f} s on port {server.port}", flush=True)
        if args.warmup:  # one-time costs (first forward, allocator) stay out of the first level
            warm, _ = asyncio.run(run_level(server, config, prompts, 1, args.warmup, min(8, args.max_tokens),
                                            args.timeout, args.api_key))
            for w in warm:
                append_jsonl(out / REQUESTS_JSONL, {"run": meta["run"], "config": name, "concurrency": 0,
                                                    "warmup": True, **w})
            if not any(w["ok"] for w in warm):
                print(f"[{name}] warm-up failed: {warm[0]['error']}", flush=True)
    except ServerFailed as e:
        print(f"[{name}] does not run: {e}\n{server.log_tail()}", flush=True)
        append_jsonl(out / JSONL, {**base, "concurrency": None, "error": str(e),
                                   "log_tail": server.log_tail().splitlines()})
        server.stop()
        return None
    except BaseException:
        server.stop()
        raise
    return Started(name, config, server, base)


def measure_level(started: Started, args: argparse.Namespace, prompts: list[str], c: int, round_: int) -> bool:
    """One round of the `c`-stream level against a started server: its rows appended. False if the server died."""
    out: Path = args.out
    name, server, base = started.name, started.server, started.base
    records, measured = asyncio.run(
        run_level(server, started.config, prompts, c, max(args.requests, c), args.max_tokens, args.timeout,
                  args.api_key, args.turns)
    )
    for r in records:
        append_jsonl(out / REQUESTS_JSONL, {"run": base["run"], "config": name, "concurrency": c, "round": round_,
                                            **r})
    row = {**base, "concurrency": c, "round": round_, **summarize(records, measured["wall_seconds"]), **measured}
    append_jsonl(out / JSONL, row)
    print(f"[{name}] c={c:<3d} round {round_}  ok {row['ok']}/{row['requests']}  "
          f"{_num(row['requests_per_second'], '.3f')} req/s  "
          f"{_num(row['output_tokens_per_second'])} tok/s  latency p50 {_num(row['latency_p50_s'])} s  "
          f"TTFT p50 {_num(row['ttft_p50_s'])} s  RSS {_mib(row['rss_mib_before'])} → "
          f"{_mib(row['rss_mib_after'])} MiB", flush=True)
    for e in row["errors"]:
        print(f"    {e['count']}× {e['error']}", flush=True)
    if measured["server_alive"]:
        return True
    print(f"[{name}] the server died; its last lines:\n{server.log_tail()}", flush=True)
    append_jsonl(out / JSONL, {**base, "concurrency": None, "error": f"the server exited during the {c}-stream level"})
    return False


def level_order(names: list[str], round_: int) -> list[str]:
    """The configurations' order in a round: as given in even rounds, reversed in odd ones (A B, B A, A B, ...), so
    a drift of the machine's speed over a level falls on every configuration alike."""
    return list(names) if round_ % 2 == 0 else list(reversed(names))


def run_configs(args: argparse.Namespace, meta: dict, prompts: list[str]) -> None:
    """`--rounds 1`: one configuration's server at a time, every level. More rounds: every server up at once (idle
    while another is measured), each level run `rounds` times in alternating order (`level_order`)."""
    if args.rounds == 1:
        for name in args.configs:
            started = start_config(name, args, meta, prompts)
            if started is None:
                continue
            try:
                for c in args.concurrency:
                    if not measure_level(started, args, prompts, c, 0):
                        break
            finally:
                started.server.stop()
        return
    running: dict[str, Started] = {}
    try:
        for name in args.configs:  # in order: a sparrow load writes the cache that `transformers serve` reads
            started = start_config(name, args, meta, prompts)
            if started is not None:
                running[started.name] = started
        for c in args.concurrency:
            for round_ in range(args.rounds):
                for name in level_order(list(running), round_):
                    if not measure_level(running[name], args, prompts, c, round_):
                        running.pop(name).server.stop()
    finally:
        for started in running.values():
            started.server.stop()


def _interrupt(signum, frame):  # SIGTERM/SIGHUP: unwind through the finally blocks that stop the servers
    raise KeyboardInterrupt(f"signal {signum}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help=f"comma-separated, of: {', '.join(CONFIG_NAMES)} (transformers serve --continuous-batching; "
                        "opt-in: on CPU it reserved about 14 GiB for its paged KV cache even for smollm2-135m)")
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--drafter", default="draft-model", help="the speculative configuration's drafter")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b", help="its draft model (drafters that take one)")
    p.add_argument("--draft-quant", default="int4", help="int8, int4 or none")
    p.add_argument("-k", type=int, default=None, help="draft tokens per round (default: the drafter's)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default=None)
    p.add_argument("--concurrency", default="1,4,8,32", type=lambda s: [int(c) for c in s.split(",") if c])
    p.add_argument("--requests", type=int, default=32, help="requests per concurrency level (at least the concurrency)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--turns", type=int, default=1,
                   help="requests per conversation: each next one sends the conversation so far and a follow-up")
    p.add_argument("--prefix-cache", type=int, default=16384,
                   help="--prefix-cache TOKENS of the *-prefix-cache configurations")
    p.add_argument("--timeout", type=float, default=1200.0,
                   help="seconds a request may take, queueing included; then it counts as failed")
    p.add_argument("--load-timeout", type=float, default=1800.0, help="seconds a server may take to load")
    p.add_argument("--warmup", type=int, default=1, help="unrecorded warm-up requests per server")
    p.add_argument("--rounds", type=int, default=2,
                   help="times each level runs; above 1 every server is up at once and the configurations take "
                        "turns in alternating order (A B B A), the table showing each level's median and range")
    p.add_argument("--prompts", default=str(HERE / "prompts.json"), help="a prompts.json file or 'spec-bench'")
    p.add_argument("--api-key", default=None, help="run the sparrow servers with --api-key and send it")
    p.add_argument("--sparrow-args", default="", help="extra `sparrow serve` options, e.g. '--max-batch 8'")
    p.add_argument("--transformers-args", default="", help="extra `transformers serve` options")
    p.add_argument("--out", type=Path, default=HERE / "results", help="directory of load_test.{jsonl,md,png}")
    p.add_argument("--render", action="store_true", help="only render the table and plot from the JSONL")
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.configs if c not in CONFIG_NAMES]
    if unknown:
        p.error(f"unknown configuration(s) {', '.join(unknown)}; expected some of {', '.join(CONFIG_NAMES)}")
    if not args.concurrency or min(args.concurrency) < 1 or min(args.requests, args.max_tokens, args.rounds, args.turns,
                                                                args.prefix_cache) < 1:
        p.error("--concurrency, --requests, --max-tokens, --rounds, --turns and --prefix-cache must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.render:
        print(render(args.out) or f"no rows in {args.out / JSONL}")
        return
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
    prompts = load_prompts(args.prompts)
    commit, dirty = git_state()
    now = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    meta = {"run": now.isoformat().replace("+00:00", "Z"), "date": now.date().isoformat(), "commit": commit,
            "dirty": dirty, "cpu": cpu_model(), "cpu_features": cpu_features(),
            "cpus": os.cpu_count(), "torch_threads": torch_threads(),
            "target": args.target, "drafter": args.drafter, "draft": args.draft, "draft_quant": args.draft_quant,
            "dtype": args.dtype, "max_tokens": args.max_tokens, "requests_per_level": args.requests,
            "rounds": args.rounds, "turns": args.turns,
            "timeout_s": args.timeout, "prompts": args.prompts if args.prompts == "spec-bench"
            else os.path.relpath(args.prompts, REPO), **versions()}
    try:
        run_configs(args, meta, prompts)
    except KeyboardInterrupt:
        print("interrupted: the servers are stopped; rows so far are kept", file=sys.stderr)
        raise SystemExit(130)
    finally:
        text = render(args.out)
        if text:
            print("\n" + text)
            print(f"rows: {args.out / JSONL}, table: {args.out / MARKDOWN}", flush=True)


if __name__ == "__main__":
    main()
