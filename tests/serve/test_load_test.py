"""benchmarks/load_test.py without a server: statistics, rows, rendering, /metrics parsing, server command lines,
and one streamed request against a mocked HTTP transport (sparrow's and transformers serve's stream shapes)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import sys
from pathlib import Path

import httpx
import pytest

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "load_test.py"
spec = importlib.util.spec_from_file_location("load_test", PATH)
lt = importlib.util.module_from_spec(spec)
sys.modules["load_test"] = lt  # dataclasses look their module up
spec.loader.exec_module(lt)


def record(ok=True, latency=1.0, ttft=0.1, tokens=32, error=None, accepted=None, drafted=0, taken=0, finish="length"):
    spec = None if accepted is None else {"mean_accepted_tokens": accepted, "num_draft_tokens": drafted,
                                          "num_accepted_tokens": taken}
    return {"ok": ok, "error": error, "latency_s": latency, "ttft_s": ttft if ok else None,
            "output_tokens": tokens if ok else None, "finish_reason": finish if ok else None, "speculative": spec}


META = {"target": "smollm2-135m", "requests_per_level": 4, "max_tokens": 32, "prompts": "benchmarks/prompts.json",
        "cpu": "AMD EPYC", "cpu_features": ["avx512_bf16"], "cpus": 2, "torch_threads": 2, "commit": "0123456789abcdef",
        "dirty": False, "transformers_version": "5.0"}


def level(config, c, run, **stats):
    base = lt.summarize([record(latency=1.0 + i) for i in range(4)], 2.0)
    return {**META, **base, "config": config, "concurrency": c, "run": run, "server_cmd": f"serve {config}",
            "rss_mib_before": 1000.0, "rss_mib_after": 1010.0, "rss_mib_peak": 1020.0, **stats}


def test_percentile_interpolates_like_numpy():
    assert lt.percentile([], 50) is None
    assert lt.percentile([7.0], 99) == 7.0
    assert lt.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert math.isclose(lt.percentile([1.0, 2.0, 3.0, 4.0], 99), 3.97)
    assert lt.percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0


def test_summarize_counts_every_request_and_rates_only_successes():
    results = [record(latency=1.0, ttft=0.2, tokens=10, accepted=2.0, drafted=8, taken=4),
               record(latency=3.0, ttft=0.4, tokens=30, accepted=4.0, drafted=8, taken=8, finish="stop"),
               record(ok=False, error="HTTP 429: queue full"), record(ok=False, error="HTTP 429: queue full"),
               record(ok=False, error="timeout: no complete answer within 5 s")]
    s = lt.summarize(results, 4.0)
    assert (s["requests"], s["ok"], s["failed"]) == (5, 2, 3)
    assert s["errors"] == [{"error": "HTTP 429: queue full", "count": 2},
                           {"error": "timeout: no complete answer within 5 s", "count": 1}]
    assert s["requests_per_second"] == 0.5 and s["output_tokens"] == 40 and s["output_tokens_per_second"] == 10.0
    assert s["latency_p50_s"] == 2.0 and s["ttft_p50_s"] == pytest.approx(0.3)
    assert s["mean_accepted_tokens"] == 3.0 and s["acceptance_rate"] == 0.75
    assert s["finish_reasons"] == {"length": 1, "stop": 1}


def test_summarize_without_successes_or_usage():
    s = lt.summarize([record(ok=False, error="boom")], 1.0)
    assert s["ok"] == 0 and s["output_tokens_per_second"] is None and s["latency_p99_s"] is None
    s = lt.summarize([{**record(), "output_tokens": None}], 1.0)  # a server that sent no usage
    assert s["requests_without_usage"] == 1 and s["output_tokens_per_second"] is None


def test_latest_rows_keeps_each_configs_newest_run():
    rows = [level("speculative", 4, "2026-01-01T00:00:00Z"), level("speculative", 1, "2026-01-01T00:00:00Z"),
            level("plain", 1, "2026-01-01T00:00:00Z"),
            {**META, "config": "transformers-serve", "concurrency": None, "run": "2026-01-01T00:00:00Z",
             "error": "gone"},
            level("speculative", 1, "2026-01-02T00:00:00Z", ok=3),
            level("transformers-serve", 1, "2026-01-02T00:00:00Z")]
    kept = lt.latest_rows(rows)
    assert [(r["config"], r["concurrency"], r["run"][:10]) for r in kept] == [
        ("speculative", 1, "2026-01-02"), ("plain", 1, "2026-01-01"), ("transformers-serve", 1, "2026-01-02")]


def test_render_markdown_rows_failures_and_settings():
    rows = [level("speculative", 1, "r1", mean_accepted_tokens=2.5), level("speculative", 4, "r1"),
            level("plain", 1, "r1", failed=1, errors=[{"error": "HTTP 500: internal\nerror", "count": 1}]),
            {**META, "config": "transformers-serve", "concurrency": None, "run": "r1",
             "error": "the server exited with code 1\nTraceback ..."}]
    text = lt.render_markdown(rows)
    lines = text.splitlines()
    table = [line for line in lines if line.startswith("| ")]
    assert len(table) == 1 + 4  # header + 3 levels + the configuration that did not run
    assert ("| speculative | 1 | 4 / 0 | 2.000 | 64.00 | 1.00 | 2.50 / 3.97 | 0.10 / 0.10 | 2.50 "
            "| 1000 → 1010 (1020) |" in lines)
    assert "| speculative | 4 | 4 / 0 | 2.000 | 64.00 | – |" in text  # no plain level of 4 streams to divide by
    assert "- **transformers-serve** did not run: the server exited with code 1 Traceback ..." in lines
    assert "- plain, 1 streams: 1× HTTP 500: internal error" in lines
    assert any("AMD EPYC (avx512_bf16), 2 CPUs, 2 torch threads; sparrow 0123456789ab," in line for line in lines)
    assert "- speculative: `serve speculative`" in lines


def test_rounds_merge_into_medians_ranges_and_ratios_within_each_round():
    run = "2026-01-01T00:00:00Z"
    rows = [level("speculative", 4, run, round=0, output_tokens_per_second=30.0, latency_p50_s=2.0, ok=4,
                  errors=[{"error": "HTTP 500: x", "count": 1}], rss_mib_after=1100.0, rss_mib_peak=1200.0),
            level("plain", 4, run, round=0, output_tokens_per_second=20.0),
            level("plain", 4, run, round=1, output_tokens_per_second=25.0),
            level("speculative", 4, run, round=1, output_tokens_per_second=36.0, latency_p50_s=3.0, ok=3,
                  errors=[{"error": "HTTP 500: x", "count": 2}], rss_mib_after=1300.0, rss_mib_peak=1250.0),
            level("speculative", 1, run, output_tokens_per_second=9.0),  # one round, no plain level to divide by
            {**META, "config": "transformers-serve", "concurrency": None, "run": run, "error": "gone"}]
    merged = {(r["config"], r["concurrency"]): r for r in lt.merge_rounds(rows)}
    spec, plain = merged["speculative", 4], merged["plain", 4]
    assert spec["level_rounds"] == 2 and spec["round_tok_s"] == [30.0, 36.0]
    assert spec["output_tokens_per_second"] == 33.0 and spec["latency_p50_s"] == 2.5 and spec["ok"] == 7
    assert spec["errors"] == [{"error": "HTTP 500: x", "count": 3}]
    assert (spec["rss_mib_before"], spec["rss_mib_after"], spec["rss_mib_peak"]) == (1000.0, 1300.0, 1250.0)
    assert spec["x_plain"] == pytest.approx(33.0 / 22.5)
    assert spec["x_plain_rounds"] == pytest.approx([1.5, 1.44])  # paired by round, not median over median
    assert "x_plain" not in plain and "x_plain" not in merged["speculative", 1]
    assert merged["transformers-serve", None]["error"] == "gone"
    text = lt.render_markdown(rows)
    assert "| speculative | 4 | 7 / 0 | 2.000 | 33.00 (30.00–36.00) | 1.47 (1.44–1.50) |" in text
    assert "| plain | 4 |" in text and "| speculative | 1 | 4 / 0 | 2.000 | 9.00 | – |" in text
    assert "4 requests per level in 2 rounds (the servers up together" in text


def test_ratios_stay_within_one_run():
    rows = [level("speculative", 1, "r2", output_tokens_per_second=30.0),  # re-run alone: plain is older
            level("plain", 1, "r1", output_tokens_per_second=10.0)]
    assert all("x_plain" not in r for r in lt.merge_rounds(rows))


def test_rounds_alternate_the_order_and_keep_every_server_up(monkeypatch, tmp_path):
    events = []

    class FakeServer:
        def __init__(self, name):
            self.name = name

        def stop(self):
            events.append(("stop", self.name))

    def start(name, args, meta, prompts):
        events.append(("start", name))
        return None if name == "transformers-serve" else lt.Started(name, None, FakeServer(name), {})

    def measure(started, args, prompts, c, round_):
        events.append((started.name, c, round_))
        return not (started.name == "plain" and c == 4)  # plain's server dies in its first 4-stream round

    monkeypatch.setattr(lt, "start_config", start)
    monkeypatch.setattr(lt, "measure_level", measure)
    args = lt.parse_args(["--configs", "speculative,plain,transformers-serve", "--concurrency", "1,4",
                          "--out", str(tmp_path)])
    assert args.rounds == 2 and lt.level_order(["a", "b"], 0) == ["a", "b"] and lt.level_order(["a", "b"], 1) == [
        "b", "a"]
    lt.run_configs(args, {}, [])
    assert events == [("start", "speculative"), ("start", "plain"), ("start", "transformers-serve"),
                      ("speculative", 1, 0), ("plain", 1, 0), ("plain", 1, 1), ("speculative", 1, 1),
                      ("speculative", 4, 0), ("plain", 4, 0), ("stop", "plain"), ("speculative", 4, 1),
                      ("stop", "speculative")]
    events.clear()
    lt.run_configs(lt.parse_args(["--configs", "speculative,plain", "--concurrency", "1,4", "--rounds", "1",
                                  "--out", str(tmp_path)]), {}, [])
    assert events == [("start", "speculative"), ("speculative", 1, 0), ("speculative", 4, 0), ("stop", "speculative"),
                      ("start", "plain"), ("plain", 1, 0), ("plain", 4, 0), ("stop", "plain")]
    with pytest.raises(SystemExit):
        lt.parse_args(["--rounds", "0"])


def test_render_writes_markdown_and_plot(tmp_path):
    rows = [level("speculative", 1, "r1"), level("speculative", 4, "r1"), level("plain", 1, "r1")]
    (tmp_path / lt.JSONL).write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = lt.render(tmp_path)
    assert (tmp_path / lt.MARKDOWN).read_text() == text and "| plain | 1 |" in text
    pytest.importorskip("matplotlib")
    assert (tmp_path / lt.PLOT).stat().st_size > 0
    assert lt.render(tmp_path / "empty") == ""


def test_prometheus_counts_between_scrapes():
    before = lt.parse_prometheus('# HELP x\nsparrow:requests_total{endpoint="/v1/chat/completions",status="200"} 3.0\n'
                                 "sparrow:generation_tokens_total 100.0\n")
    after = lt.parse_prometheus('sparrow:requests_total{endpoint="/v1/chat/completions",status="200"} 10.0\n'
                                'sparrow:requests_total{status="429",endpoint="/v1/chat/completions"} 1.0\n'
                                'sparrow:requests_total{endpoint="/v1/models",status="200"} 5.0\n'
                                "sparrow:generation_tokens_total 324.0\n")
    assert lt.server_counts(before, after) == {"server_requests": {"200": 7, "429": 1},
                                               "server_generation_tokens": 224}


def test_server_command_lines():
    args = lt.parse_args(["--target", "smollm2-135m", "--drafter", "prompt-lookup", "--concurrency", "1,64"])
    assert args.configs == ["speculative", "plain", "transformers-serve"] and args.concurrency == [1, 64]
    spec = lt.sparrow_config("speculative", args, drafting=True).argv
    assert spec[spec.index("--drafter") + 1] == "prompt-lookup" and "--draft" not in spec  # takes no draft model
    assert spec[spec.index("--max-queue") + 1] == "64"
    plain = lt.sparrow_config("plain", args, drafting=False).argv
    assert plain[plain.index("--drafter") + 1] == "none"
    args = lt.parse_args(["--sparrow-args", "--max-batch 4 --max-queue 8"])
    spec = lt.sparrow_config("speculative", args, drafting=True).argv
    assert spec[-4:] == ["--max-batch", "4", "--max-queue", "8"] and spec.count("--max-queue") == 1
    assert spec[spec.index("--draft") + 1] == "qwen2.5-coder-0.5b" and spec[spec.index("--draft-quant") + 1] == "int4"
    with pytest.raises(SystemExit):
        lt.parse_args(["--configs", "speculative,vllm"])


def sse(*events) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


def chunk(content=None, finish=None, usage=None, choices=True):
    out = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
           "choices": [{"index": 0, "delta": {} if content is None else {"content": content},
                        "finish_reason": finish}] if choices else []}
    if usage is not None:
        out["usage"] = usage
    return out


def request_with(body: bytes, status: int = 200, timeout: float = 5.0) -> dict:
    from openai import AsyncOpenAI

    async def handler(request: httpx.Request) -> httpx.Response:
        sent = json.loads(request.content)
        assert sent["stream"] and sent["stream_options"] == {"include_usage": True} and sent["temperature"] == 0
        if status != 200:
            return httpx.Response(status, json={"error": {"message": "queue is full", "type": "rate_limit_error"}})
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    async def go():
        client = AsyncOpenAI(base_url="http://test/v1", api_key="k", max_retries=0,
                             http_client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
        try:
            return await lt.one_request(client, "m", [{"role": "user", "content": "hi"}], 8, timeout)
        finally:
            await client.close()

    return asyncio.run(go())


def test_one_request_reads_sparrow_and_transformers_streams():
    usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
             "speculative": {"num_drafts": 1, "num_draft_tokens": 4, "num_accepted_tokens": 2,
                             "mean_accepted_tokens": 3.0, "acceptance_rate": 0.5}}
    r = request_with(sse(chunk(""), chunk("a"), chunk("bc"), chunk(finish="length"), chunk(usage=usage, choices=False),
                         b"[DONE]"))
    assert r["ok"] and r["error"] is None and r["output_tokens"] == 3 and r["chunks"] == 2
    assert r["finish_reason"] == "length" and r["speculative"]["mean_accepted_tokens"] == 3.0
    assert 0 <= r["ttft_s"] <= r["latency_s"]
    plain_usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}  # on the finish chunk, no [DONE]
    r = request_with(sse(chunk("a"), chunk("b"), chunk(finish="stop", usage=plain_usage)))
    assert r["ok"] and r["output_tokens"] == 2 and r["speculative"] is None


def test_one_request_records_failures():
    r = request_with(b"", status=429)
    assert not r["ok"] and r["error"] == "HTTP 429: queue is full" and r["latency_s"] is not None
    r = request_with(sse(chunk("a"), {"error": {"message": "internal error: boom", "type": "internal_error"}}))
    assert not r["ok"] and "internal error: boom" in r["error"]
    r = request_with(sse(chunk("a")))  # cut off before the finish chunk
    assert not r["ok"] and r["error"] == "the stream ended without a finish_reason"


def test_conversations_send_the_turns_so_far_and_count_cached_tokens(monkeypatch):
    """--turns 3: each conversation's next request carries its earlier messages, the answers and the next follow-up;
    every turn is a record, and the summary gives the later turns' TTFT and the prompt tokens the cache served."""
    import os

    import openai

    sent = []

    async def handler(request: httpx.Request) -> httpx.Response:
        messages = json.loads(request.content)["messages"]
        sent.append(messages)
        turn = (len(messages) - 1) // 2
        usage = {"prompt_tokens": 10 * (turn + 1), "completion_tokens": 1, "total_tokens": 10 * (turn + 1) + 1,
                 "prompt_tokens_details": {"cached_tokens": 10 * turn}}
        body = sse(chunk(f"answer {turn}"), chunk(finish="length"), chunk(usage=usage, choices=False), b"[DONE]")
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    real = openai.AsyncOpenAI
    monkeypatch.setattr(openai, "AsyncOpenAI", lambda **kw: real(
        **kw, http_client=httpx.AsyncClient(transport=httpx.MockTransport(handler))))

    class FakeServer:
        base_url = "http://test"
        proc = type("Proc", (), {"pid": os.getpid(), "poll": lambda self: None})()

        def metrics(self):
            return None

    config = lt.ServerConfig("plain-prefix-cache", "sparrow", model="m")
    records, measured = asyncio.run(lt.run_level(FakeServer(), config, ["first", "second"], 2, 2, 8, 5.0, None,
                                                 turns=3))
    assert len(records) == 6 and all(r["ok"] for r in records)
    assert sorted((r["prompt_index"], r["turn"]) for r in records) == [(i, t) for i in range(2) for t in range(3)]
    third = next(m for m in sent if len(m) == 5 and m[0]["content"] == "second")
    assert [m["role"] for m in third] == ["user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in third[1:]] == ["answer 0", lt.FOLLOW_UPS[0], "answer 1", lt.FOLLOW_UPS[1]]
    s = lt.summarize(records, measured["wall_seconds"])
    assert s["cached_prompt_tokens"] == 2 * (0 + 10 + 20) and s["prompt_tokens"] == 2 * (10 + 20 + 30)
    assert s["ttft_follow_up_p50_s"] is not None and s["requests"] == 6
    text = lt.render_markdown([{**META, **s, "config": "plain-prefix-cache", "concurrency": 2, "run": "r1",
                                "turns": 3}])
    assert "60 of 120 prompt tokens taken from the prefix cache" in text and "conversations of 3 turns" in text
