"""sparrow on a lent GPU: one command that turns one lend into a complete, honest table (issue #41).

    python benchmarks/gpu_run.py prepare --dir .gpu            # here, once: model chunks, prompts, wheels
    python benchmarks/gpu_run.py run --target .gpu/target --draft .gpu/draft --out $OUT --budget 420   # the device
    python benchmarks/gpu_run.py run --device cpu --target DIR --draft DIR --out /tmp/dry --sets spec-bench-quick \\
        --prompts-per-set 1 --max-new-tokens 8 --budget 120     # the CPU dry run (a test runs it)

`run` does, in order, each stage within its share of `--budget` seconds (counted from the start; a stage that runs
out stops where it is and the next begins), writing under OUT as it goes, so a run cut off still returns what it
measured (at most 8 files, as a device call brings back):
1. `cuda-tests`: `pytest -m cuda` (tests/runtime/test_cuda.py) in a subprocess -> OUT/cuda_tests.txt;
2. `lossless`: the real target in float32: each drafter's greedy output == plain decoding's, token for token, with
   drafts accepted -> OUT/lossless.jsonl;
3. `table`: batch 1, `--dtype` (bf16), chat template, on the foundation prompts, `sparrow bench --quick`'s Spec-Bench
   questions and EAGLE's HumanEval questions: transformers' plain `generate`, its assisted generation (the draft)
   and prompt lookup; sparrow plain (eager, and compiled: CUDA graphs on a GPU), `draft-model`, `prompt-lookup`,
   `suffix`, `eagle` (when a head is found) and `auto`: tok/s, tokens per target forward, the draft's cost per
   token as a share of a target forward, identical to plain -> OUT/batch1.jsonl (one row per prompt x method, the
   rows of `sparrow bench`);
4. `profile`: one speculative generation under torch.profiler: where the milliseconds go (target, draft, host
   syncs: `aten::_local_scalar_dense` calls per round) -> OUT/profile.txt;
5. `server`: `benchmarks/load_test.py` (speculative against plain, `--streams`), when its packages are importable
   -> OUT/load_test.jsonl.
OUT/report.md (the tables, rendered from the rows) and OUT/log.txt (the caller's tee) complete the eight.

`--target` / `--draft`: a transformers directory, a .gguf file, or a directory of GGUF chunks (`SHA256SUMS`, as
`prepare` cuts them; joined and checked there). The device machine is bare (torch, transformers 5.17: sparrow needs
>= 5.24): `prepare` downloads the wheels the run installs with pip --no-index (docs/results/gpu.md: the runbook).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

STAGES = ("cuda-tests", "lossless", "table", "profile", "server")
SHARES = {"cuda-tests": 0.08, "lossless": 0.12, "table": 0.55, "profile": 0.05, "server": 0.20}
"""Each stage's share of the budget; time a stage leaves unused goes to the next."""
CUDA_TESTS_FLOOR = 60.0  # seconds the CUDA tests get whatever their share (pytest and CUDA start in ~15 s alone; on
# a busy 2-core CPU the dry run's 17 s share ran out while pytest was still importing)
TABLE_METHODS = ("hf-plain", "hf-assisted", "hf-prompt-lookup", "plain", "plain-compiled", "draft-model",
                 "prompt-lookup", "suffix", "eagle", "auto")
LOSSLESS_DRAFTERS = ("draft-model", "prompt-lookup", "suffix", "eagle", "auto")
SERVER_PACKAGES = ("fastapi", "uvicorn", "pydantic", "prometheus_client", "openai", "typer", "rich", "httpx")
WHEELS = ("transformers==5.24.0", "gguf==0.19.0", "pytest", "fastapi", "uvicorn", "pydantic", "prometheus-client",
          "openai", "typer", "rich", "httpx", "psutil", "llguidance")
"""What `prepare` downloads (with their dependencies) for the device's Python: transformers >= 5.24 (sparrow passes
`cache=`), gguf for a GGUF target, pytest for the CUDA tests, the server's and the load test's packages."""
DEVICE_PYTHONS = ("3.11", "3.12", "3.13")  # transformers >= 5.21 needs Python >= 3.11
PROFILE_TOKENS = 32


# --- the clock and the files ------------------------------------------------------------------------------------

class Clock:
    """The run's deadline, shared out among the stages in order."""

    def __init__(self, budget: float) -> None:
        self.start, self.budget = time.monotonic(), budget
        self.stage_end = self.start

    def left(self) -> float:
        return self.start + self.budget - time.monotonic()

    def begin(self, stage: str, shares_left: float) -> float:
        """The stage's deadline: its share of what is left (a share of 1 for the last stage)."""
        seconds = self.left() * SHARES[stage] / shares_left
        self.stage_end = time.monotonic() + seconds
        return seconds

    def stage_left(self) -> float:
        return self.stage_end - time.monotonic()


class Sink:
    """JSONL rows appended and flushed one by one (a killed run keeps every row written)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, row: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def rows(self) -> list[dict]:
        return [json.loads(line) for line in self.path.read_text().splitlines()] if self.path.is_file() else []


def say(*parts: object) -> None:
    print(f"[gpu_run {time.strftime('%H:%M:%S')}]", *parts, flush=True)


def sync(device: Any) -> None:
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.synchronize()


# --- the models ---------------------------------------------------------------------------------------------------

def model_file(spec: str) -> str:
    """A chunks directory joined (and checked) into its .gguf; a directory or .gguf file as it is."""
    from sparrow.training.chunks import SUMS, join_chunks

    path = Path(spec)
    if path.is_dir() and (path / SUMS).is_file():
        return str(join_chunks(path))
    if not path.exists():
        raise SystemExit(f"--target/--draft {spec!r}: no such directory, .gguf file or chunks directory")
    return spec


def load_one(spec: str, dtype: str, device: str) -> Any:
    """sparrow's loader; a GGUF's metadata parsed once and its tensors dequantized on every core (the recipe's)."""
    from sparrow.models import load_model
    from sparrow.training.recipe_data import fast_gguf_loading

    start = time.perf_counter()
    path = Path(spec)
    fast = fast_gguf_loading(path, os.cpu_count() or 1) if path.suffix == ".gguf" else contextlib.nullcontext()
    with fast:
        loaded = load_model(spec, dtype=dtype, device=device, progress=False)
    say(f"{spec} ({dtype}, {device}) loaded in {time.perf_counter() - start:.1f} s")
    return loaded


def load_pair(target: str, draft: str | None, dtype: str, device: str) -> tuple[Any, Any]:
    return load_one(target, dtype, device), load_one(draft, dtype, device) if draft is not None else None


def cast(pair: tuple[Any, Any], dtype: str) -> tuple[Any, Any]:
    """The same models in another dtype, in place (the float32 check's models become the table's)."""
    import torch

    for loaded in pair:
        if loaded is not None:
            loaded.model.to(getattr(torch, dtype))
    return pair


def pipeline(method: str, target: Any, draft: Any, head: str | None) -> Any:
    """sparrow's pipeline of a table method ("plain": no drafter; "<m>-compiled": compile=True)."""
    from sparrow.loading import load

    compiled = method.endswith("-compiled")
    name = method.removesuffix("-compiled")
    name = "none" if name == "plain" else name
    options = {"head": head} if name == "eagle" else {}
    uses_draft = name in ("draft-model", "auto")
    return load(target, drafter=name, draft=draft if uses_draft else None, compile=compiled, progress=False,
                **options)


def methods_here(methods: list[str], draft: Any, head: str | None) -> tuple[list[str], dict[str, str]]:
    """The methods this run can measure, and why each other one is left out."""
    left_out = {}
    for m in methods:
        if m == "eagle" and head is None:
            left_out[m] = "no head: none shipped for the preset and no --head"
        elif m in ("hf-assisted", "draft-model") and draft is None:
            left_out[m] = "no --draft"
    return [m for m in methods if m not in left_out], left_out


# --- the stages ---------------------------------------------------------------------------------------------------

def stage_cuda_tests(args: argparse.Namespace, out: Path, seconds: float, **_: Any) -> dict:
    """`pytest -m cuda` in a subprocess (skipped, and said so, without a GPU)."""
    command = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
               str(REPO / "tests" / "runtime" / "test_cuda.py")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), *sys.path])}
    seconds = max(seconds, CUDA_TESTS_FLOOR)
    try:
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=seconds)
        text, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:  # its output so far (bytes, whatever `text` asked)
        partial = "".join(p.decode(errors="replace") if isinstance(p, bytes) else p or "" for p in (e.stdout, e.stderr))
        text, code = f"{partial}\n(timed out after {seconds:.0f} s)", None
    (out / "cuda_tests.txt").write_text(" ".join(command) + "\n\n" + str(text))
    words = ("passed", "failed", "skipped", "error", "deselected")  # pytest's closing line names some of them
    summary = next((line for line in reversed(str(text).splitlines()) if any(w in line for w in words)), "")
    return {"exit_code": code, "summary": summary.strip(" =")}


def stage_lossless(args: argparse.Namespace, out: Path, models: tuple, head: str | None, clock: Clock,
                   prompts: list[dict], **_: Any) -> dict:
    """float32: each drafter's greedy output == plain decoding's, with drafts accepted (asserted per drafter)."""
    target, draft = models
    sink = Sink(out / "lossless.jsonl")
    drafters, left_out = methods_here(list(args.lossless), draft, head)
    results = {}
    texts = [p["prompt"] for p in prompts[: args.lossless_prompts]]
    plain_pipe = pipeline("plain", target, draft, head)
    plain = {}
    for name in drafters:
        if clock.stage_left() <= 0:
            left_out[name] = "out of the stage's time"
            continue
        pipe = pipeline(name, target, draft, head)
        same = accepted = 0
        for text in texts:
            if text not in plain:
                plain[text] = plain_pipe.generate_plain(text, max_new_tokens=args.lossless_tokens,
                                                        chat=args.chat).token_ids
            result = pipe.generate(text, max_new_tokens=args.lossless_tokens, chat=args.chat)
            same += result.token_ids == plain[text]
            accepted += result.stats.num_accepted_tokens
        row = {"drafter": name, "dtype": "float32", "device": args.device, "prompts": len(texts),
               "identical": same, "accepted_tokens": accepted, "lossless": same == len(texts) and accepted > 0}
        sink.write(row)
        results[name] = row
        say(f"lossless {name}: {same}/{len(texts)} identical, {accepted} drafts accepted")
    return {"drafters": {n: r["lossless"] for n, r in results.items()}, "left_out": left_out}


def questions_of(prompts: list[dict]) -> list[Any]:
    from sparrow.bench.data import Question

    return [Question(question_id=p["id"], category=p["kind"], turns=(p["prompt"],)) for p in prompts]


def stage_table(args: argparse.Namespace, out: Path, models: tuple, head: str | None, clock: Clock,
                prompts: list[dict], **_: Any) -> dict:
    """Batch 1: every method on every prompt, interleaved per prompt (drift hits all alike); rows as they come."""
    from sparrow.bench.runner import BenchConfig, Models, Runner, environment

    target, draft = models
    sink = Sink(out / "batch1.jsonl")
    methods, left_out = methods_here(list(args.methods), draft, head)
    plain_methods = [m for m in methods if not m.endswith("-compiled") and m not in ("auto",)]
    config = BenchConfig(target=args.target, draft=args.draft, cross_draft=None, dtype=args.dtype, k=None,
                         adaptive=False, max_new_tokens=args.max_new_tokens, turns=1, chat=args.chat,
                         device=args.device, head=head)
    runner = Runner([m for m in plain_methods if m != "eagle"], Models(target, draft), config)
    for m in methods:  # the pipelines Runner does not build: compiled ones, auto and eagle (a head by path)
        if m not in runner.pipes and not m.startswith("hf-"):
            start = time.perf_counter()
            try:
                runner.pipes[m] = pipeline(m, target, draft, head)
            except Exception as e:  # noqa: BLE001 - a method that cannot load is reported, the others still run
                left_out[m] = f"{type(e).__name__}: {e}"
                say(f"table: {m} left out: {left_out[m]}")
                continue
            say(f"table: {m} ready in {time.perf_counter() - start:.1f} s")
    runner.methods = [m for m in methods if m not in left_out]
    env = {**environment(target), "gpu": gpu_name()}
    questions = questions_of(prompts)
    warm = min(16, args.max_new_tokens)
    for method in runner.methods:  # warm-up: kernels, allocator, CUDA graph capture
        runner.run_question(method, questions[0], max_new_tokens=warm)
    say(f"table: warmed up, {clock.stage_left():.0f} s left for {len(questions)} prompts x {len(runner.methods)}")
    done = 0
    for question, prompt in zip(questions, prompts):
        if clock.stage_left() <= 0:
            break
        outs = {}
        for method in runner.methods:
            out_ = runner.run_question(method, question)
            outs[method] = out_
            base = "hf-plain" if method.startswith("hf-") else "plain"
            row = {**env, "set": prompt["set"], "question_id": question.question_id, "kind": question.category,
                   "method": method, "baseline": base, "dtype": args.dtype,
                   **{k: v for k, v in out_.items() if k != "token_ids"},
                   "identical_to_baseline": out_["token_hash"] == outs[base]["token_hash"] if base in outs else None,
                   "identical_to_plain": out_["token_hash"] == outs["plain"]["token_hash"] if "plain" in outs
                   else None}
            sink.write(row)
        done += 1
    return {"prompts": done, "of": len(questions), "methods": runner.methods, "left_out": left_out}


def stage_profile(args: argparse.Namespace, out: Path, models: tuple, head: str | None, prompts: list[dict],
                  **_: Any) -> dict:
    """One speculative generation (the draft model, or prompt lookup without one) under torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    target, draft = models
    method = "draft-model" if draft is not None else "prompt-lookup"
    pipe = pipeline(method, target, draft, head)
    text = prompts[0]["prompt"]
    pipe.generate(text, max_new_tokens=8, chat=args.chat)  # warm
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    device = target.model.device
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        result = pipe.generate(text, max_new_tokens=PROFILE_TOKENS, chat=args.chat)
        sync(device)
        wall = time.perf_counter() - start
    events = prof.key_averages()
    rounds = max(result.stats.steps, 1)
    syncs = sum(e.count for e in events if e.key in ("aten::_local_scalar_dense", "cudaStreamSynchronize"))
    s = result.stats
    summary = {"method": method, "tokens": len(result.token_ids), "rounds": rounds, "wall_s": round(wall, 4),
               "ms_per_round": round(1000 * wall / rounds, 3),
               "draft_ms_per_round": round(1000 * s.draft_seconds / rounds, 3),
               "verify_ms_per_round": round(1000 * s.verify_seconds / rounds, 3),
               "host_syncs_per_round": round(syncs / rounds, 2),
               "mean_accepted_tokens": s.mean_accepted_tokens}
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    (out / "profile.txt").write_text(json.dumps(summary) + "\n\n" + events.table(sort_by=key, row_limit=40))
    return summary


def missing_packages(names: tuple[str, ...]) -> list[str]:
    return [n for n in names if importlib.util.find_spec(n) is None]


def stage_server(args: argparse.Namespace, out: Path, models: tuple, seconds: float, work: Path, **_: Any) -> dict:
    """The load test (speculative against plain, every server up at once) on the saved models, bounded in time."""
    missing = missing_packages(SERVER_PACKAGES)
    if missing:
        return {"skipped": f"packages missing: {', '.join(missing)} (carry the wheels `prepare` downloads)"}
    target, draft = models
    saved = {}
    for name, loaded in (("target", target), ("draft", draft)):
        if loaded is not None:
            saved[name] = work / f"server-{name}"
            loaded.model.save_pretrained(saved[name])
            loaded.tokenizer.save_pretrained(saved[name])
    rows = work / "load"
    command = [sys.executable, str(HERE / "load_test.py"), "--configs", "speculative,plain", "--target",
               str(saved["target"]), "--dtype", args.dtype, "--device", args.device, "--concurrency", args.streams,
               "--requests", str(args.server_requests), "--max-tokens", str(args.server_tokens), "--rounds", "1",
               "--warmup", "1", "--out", str(rows), "--load-timeout", str(max(30, seconds / 3))]
    if "draft" in saved:
        command += ["--drafter", "draft-model", "--draft", str(saved["draft"]), "--draft-quant", "none"]
    else:
        command += ["--drafter", "prompt-lookup"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), *sys.path])}
    try:
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=max(seconds, 20))
        code, tail = done.returncode, (done.stdout + done.stderr)[-3000:]
    except subprocess.TimeoutExpired as e:
        code, tail = None, f"timed out after {seconds:.0f} s: {str(e.stdout or '')[-2000:]}"
    say("server:", tail)
    if (rows / "load_test.jsonl").is_file():
        shutil.copy(rows / "load_test.jsonl", out / "load_test.jsonl")
    table = (rows / "load_test.md").read_text() if (rows / "load_test.md").is_file() else ""
    return {"exit_code": code, "table": table}


STAGE_RUNS: dict[str, Callable[..., dict]] = {"cuda-tests": stage_cuda_tests, "lossless": stage_lossless,
                                              "table": stage_table, "profile": stage_profile, "server": stage_server}


# --- the report ---------------------------------------------------------------------------------------------------

def summarize(rows: list[dict]) -> list[dict]:
    """Per (set, method): mean tok/s, x its baseline, x sparrow plain (eager and compiled), tokens per target
    forward, the draft's cost per token as a share of a target forward, identical outputs."""
    by = defaultdict(list)
    for r in rows:
        by[(r["set"], r["method"])].append(r)

    def tps(key: tuple) -> float | None:
        group = by.get(key)
        return statistics.mean(r["tokens_per_second"] for r in group) if group else None

    table = []
    for (set_, method), group in by.items():
        speed = tps((set_, method))
        forwards = sum(r["target_forwards"] or 0 for r in group)
        drafted = sum(r.get("num_draft_tokens") or 0 for r in group)
        verify = sum(r.get("verify_seconds") or 0 for r in group)
        steps = sum(r.get("decoding_steps") or 0 for r in group)
        draft_s = sum(r.get("draft_seconds") or 0 for r in group)
        cost = (draft_s / drafted) / (verify / steps) if drafted and verify and steps else None
        entry = {"set": set_, "method": method, "prompts": len(group), "tok_s": speed,
                 "tokens_per_forward": sum(r["new_tokens"] for r in group) / forwards if forwards else None,
                 "draft_cost_share": cost,
                 "identical": sum(bool(r["identical_to_baseline"]) for r in group)}
        for name, base in (("x_baseline", (set_, group[0]["baseline"])), ("x_plain", (set_, "plain")),
                           ("x_compiled", (set_, "plain-compiled"))):
            b = tps(base)
            entry[name] = speed / b if speed and b else None
        table.append(entry)
    return table


def _fmt(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def render(out: Path, stages: dict[str, dict], meta: dict) -> str:
    lines = ["# sparrow on a GPU: one run", "", "```", json.dumps(meta, indent=1), "```", "", "## Stages", ""]
    lines += [f"- **{name}**: `{json.dumps({k: v for k, v in result.items() if k != 'table'})[:600]}`"
              for name, result in stages.items()]
    table = summarize(Sink(out / "batch1.jsonl").rows())
    if table:
        lines += ["", "## Batch 1", "", "| set | method | prompts | tok/s | x baseline | x sparrow plain | "
                  "x compiled plain | tok/forward | draft cost / target fwd | identical to baseline |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for e in table:
            lines.append(f"| {e['set']} | {e['method']} | {e['prompts']} | {_fmt(e['tok_s'])} | "
                         f"{_fmt(e['x_baseline'])} | {_fmt(e['x_plain'])} | {_fmt(e['x_compiled'])} | "
                         f"{_fmt(e['tokens_per_forward'])} | {_fmt(e['draft_cost_share'])} | "
                         f"{e['identical']}/{e['prompts']} |")
    load = stages.get("server", {}).get("table")
    if load:
        lines += ["", "## Server", "", load]
    text = "\n".join(lines) + "\n"
    (out / "report.md").write_text(text)
    return text


# --- the command --------------------------------------------------------------------------------------------------

def gpu_name() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def metadata(args: argparse.Namespace) -> dict:
    import torch
    import transformers

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return {"gpu": gpu_name(), "device": args.device, "cpu": platform.processor() or platform.machine(),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "commit": commit.stdout.strip() or None,
            "target": args.target, "draft": args.draft, "dtype": args.dtype, "budget_s": args.budget,
            "max_new_tokens": args.max_new_tokens, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


@contextlib.contextmanager
def stage_guard(name: str, stages: dict[str, dict]) -> Iterator[None]:
    """A failing stage is reported (its traceback in the log) and the run goes on with the next."""
    start = time.perf_counter()
    try:
        yield
    except Exception as e:  # noqa: BLE001 - every stage's failure is a result to bring back
        traceback.print_exc()
        stages[name] = {"error": f"{type(e).__name__}: {e}"}
    stages[name]["seconds"] = round(time.perf_counter() - start, 1)
    say(f"stage {name}: {json.dumps(stages[name])[:400]}")


def find_head_for(args: argparse.Namespace) -> str | None:
    if args.head:
        return args.head
    from sparrow.heads.layout import find_head

    found = find_head(args.preset) if args.preset else None
    return str(found) if found is not None else None


def run(args: argparse.Namespace) -> int:
    clock = Clock(args.budget)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device (use --device cpu for the dry run)")
    from common import load_prompt_sets

    prompts = load_prompt_sets(list(args.sets), eagle_data=Path(args.eagle_data),
                               code_questions=args.prompts_per_set)
    per_set = defaultdict(list)
    for p in prompts:
        per_set[p["set"]].append(p)
    prompts = [p for group in per_set.values() for p in group[: args.prompts_per_set]]
    meta = metadata(args)
    stages: dict[str, dict] = {}
    head = find_head_for(args)
    say(f"{meta}; head {head}; {len(prompts)} prompts")
    if "cuda-tests" in args.stages:
        with stage_guard("cuda-tests", stages):
            stages["cuda-tests"] = stage_cuda_tests(args, out, clock.begin("cuda-tests", 1.0))
    render(out, stages, meta)
    models = None
    with stage_guard("load", stages):
        models = load_pair(model_file(args.target), model_file(args.draft) if args.draft else None,
                           "float32" if "lossless" in args.stages else args.dtype, args.device)
        stages["load"] = {"left_s": round(clock.left(), 1)}
    if models is None:
        render(out, stages, meta)
        return 1
    later = [s for s in STAGES[1:] if s in args.stages]
    for i, name in enumerate(later):
        if name == "table" and "lossless" in args.stages:
            cast(models, args.dtype)
        shares = sum(SHARES[s] for s in later[i:])
        seconds = clock.begin(name, shares)
        if seconds <= 1:
            stages[name] = {"skipped": "no time left"}
            continue
        with stage_guard(name, stages):
            stages[name] = STAGE_RUNS[name](args=args, out=out, models=models, head=head, clock=clock,
                                            prompts=prompts, seconds=seconds, work=work)
        render(out, stages, meta)
    print(render(out, stages, meta), flush=True)
    return 0


# --- prepare (here) and install (there) -----------------------------------------------------------------------

def prepare(args: argparse.Namespace) -> int:
    """The device's carry: each preset's GGUF as chunks, EAGLE's HumanEval questions, the wheels (with their
    dependencies, for every Python the device may have, less what a machine with torch and transformers has)."""
    from common import EAGLE_DATA

    from sparrow.training.recipe import prepare as split_preset

    root = Path(args.dir)
    for role, preset in (("target", args.preset), ("draft", args.draft_preset)):
        chunks = split_preset(preset, str(root / role), args.chunk_bytes)
        say(f"{role}: {preset} in {len(chunks)} chunks under {root / role}")
    questions = EAGLE_DATA / "humaneval.jsonl"
    if not questions.is_file():
        raise SystemExit(f"no HumanEval questions at {questions}")
    (root / "prompts").mkdir(parents=True, exist_ok=True)
    (root / "prompts" / "humaneval.jsonl").write_text("".join(questions.read_text().splitlines(keepends=True)[:20]))
    wheels = root / "wheels"
    for version in DEVICE_PYTHONS:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "-d", str(wheels), "--only-binary=:all:",
                        "--python-version", version, "--platform", "manylinux2014_x86_64", "--platform",
                        "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64", *WHEELS], check=True)
    for wheel in wheels.iterdir():
        if wheel_name(wheel)[0] in ON_THE_DEVICE:
            wheel.unlink()
    total = sum(f.stat().st_size for f in wheels.iterdir())
    say(f"wheels: {len(list(wheels.iterdir()))} files, {total / 2**20:.1f} MiB under {wheels}")
    return 0


ON_THE_DEVICE = {"torch", "numpy", "triton", "sympy", "mpmath", "networkx", "jinja2", "markupsafe", "filelock",
                 "fsspec", "setuptools", "pip"}
"""Distributions a machine with torch and transformers has: never carried (nvidia-* neither)."""


def wheel_name(path: Path) -> tuple[str, str]:
    """A wheel file's normalised distribution name and version."""
    name, version = path.name.split("-")[:2]
    return name.lower().replace("_", "-").replace(".", "-"), version


def version_key(version: str) -> tuple:
    return tuple(int(p) if p.isdigit() else 0 for p in version.replace("-", ".").split(".")[:4])


def install(args: argparse.Namespace) -> int:
    """There, first: each carried distribution this Python lacks, or has older than the carried one, installed
    without its dependencies into --site (put first on PYTHONPATH); one line per distribution."""
    from importlib import metadata

    wheels = Path(args.wheels)
    newest: dict[str, str] = {}
    for wheel in wheels.glob("*.whl"):
        name, version = wheel_name(wheel)
        if name not in ON_THE_DEVICE and not name.startswith("nvidia-"):
            newest[name] = max(newest.get(name, version), version, key=version_key)
    wanted = []
    for name, version in sorted(newest.items()):
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = None
        if have is None or version_key(have) < version_key(version):
            wanted.append(f"{name}=={version}")
            print(f"{name} {have or '-'} -> {version}")
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--find-links", str(wheels), "--target", args.site, "--upgrade"]
    if not wanted or subprocess.run(pip + wanted).returncode == 0:  # all at once; else one by one, saying which fail
        print(f"installed {len(wanted)} distributions into {args.site}")
        return 0
    failed = [w for w in wanted if subprocess.run(pip + [w]).returncode != 0]
    print(f"not installed: {', '.join(failed)}")
    return 1 if any(w.startswith("transformers==") for w in failed) else 0


SITE = "/tmp/site"


def plan(args: argparse.Namespace) -> int:
    """The device calls, in order, as JSON lines ({"carry": [...], "command": ..., "timeout_s": ...}): the first
    carries the wheels, the prompts and the checksum lists and installs the wheels; then as many chunks a call as
    fit beside the working tree; the last runs the whole thing within `--budget`."""
    from sparrow.training.chunks import CARRY_BYTES, MARGIN_BYTES, tree_bytes

    root = Path(args.dir)
    room = CARRY_BYTES - MARGIN_BYTES - (tree_bytes(REPO) or 0)
    first = [root / "wheels", root / "prompts", root / "target" / "SHA256SUMS", root / "draft" / "SHA256SUMS"]
    used = sum(f.stat().st_size for d in first for f in ([d] if d.is_file() else d.iterdir()))
    chunks = sorted((root / "target").glob("*.part-*")) + sorted((root / "draft").glob("*.part-*"))
    calls: list[list[Path]] = [first]
    for chunk in sorted(chunks, key=lambda c: -c.stat().st_size):  # the largest first: fewer calls
        size = chunk.stat().st_size
        fit = next((c for c in calls if sum(p.stat().st_size for p in c if p.is_file()) + (used if c is first
                    else 0) + size <= room), None)
        if fit is None:
            calls.append(fit := [])
        fit.append(chunk)
    install = (f"nvidia-smi --query-gpu=name,memory.total --format=csv; python3 --version; python3 benchmarks/"
               f"gpu_run.py install --wheels {root / 'wheels'} --site {SITE}")
    last = (f"set -o pipefail; export PYTHONPATH={SITE}:$PWD/src PYTHONUNBUFFERED=1; timeout -k 20 "
            f"$((B + 40)) python3 benchmarks/gpu_run.py run --target {root / 'target'} --draft {root / 'draft'} "
            f"--eagle-data {root / 'prompts'} --out $OUT --budget B 2>&1 | tee $OUT/log.txt")
    for i, carry in enumerate(calls):
        command = install if i == 0 else "ls .gpu/*/ | wc -l"
        timeout = 180 if i == 0 else 60
        if i == len(calls) - 1:
            command, timeout = last, "B + 60"
        print(json.dumps({"call": i + 1, "carry": [str(p) for p in carry], "command": command,
                          "timeout_s": timeout}))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = p.add_subparsers(dest="command", required=True)
    pre = commands.add_parser("prepare", help="here: chunks, prompts and wheels under --dir")
    pre.add_argument("--dir", default=".gpu")
    pre.add_argument("--preset", default="qwen2.5-coder-1.5b")
    pre.add_argument("--draft-preset", default="qwen2.5-coder-0.5b")
    pre.add_argument("--chunk-bytes", type=int, default=None,
                     help="default: what fits one device call beside the working tree (the recipe's rule)")
    pl = commands.add_parser("plan", help="here, after prepare: the device calls to make, as JSON lines")
    pl.add_argument("--dir", default=".gpu")
    i = commands.add_parser("install", help="there: the carried wheels this Python lacks, into --site")
    i.add_argument("--wheels", default=".gpu/wheels")
    i.add_argument("--site", default="/tmp/site")
    r = commands.add_parser("run", help="the device's run (or the CPU dry run)")
    r.add_argument("--target", default=".gpu/target")
    r.add_argument("--draft", default=".gpu/draft", help="'' for none")
    r.add_argument("--preset", default="qwen2.5-coder-1.5b", help="whose shipped head `eagle` uses")
    r.add_argument("--head", default=None)
    r.add_argument("--out", required=True)
    r.add_argument("--work", default="/tmp/gpu_run", help="scratch: the server's saved models")
    r.add_argument("--device", default="cuda")
    r.add_argument("--dtype", default="bfloat16")
    r.add_argument("--budget", type=float, default=420.0, help="seconds for the whole run, loading included")
    r.add_argument("--stages", default=",".join(STAGES))
    r.add_argument("--methods", default=",".join(TABLE_METHODS))
    r.add_argument("--lossless", default=",".join(LOSSLESS_DRAFTERS), help="drafters of the float32 check")
    r.add_argument("--lossless-prompts", type=int, default=2)
    r.add_argument("--lossless-tokens", type=int, default=48)
    r.add_argument("--sets", default="foundation,spec-bench-quick,humaneval")
    r.add_argument("--prompts-per-set", type=int, default=3)
    r.add_argument("--eagle-data", default=".gpu/prompts", help="the directory of humaneval.jsonl")
    r.add_argument("--max-new-tokens", type=int, default=128)
    r.add_argument("--no-chat", dest="chat", action="store_false")
    r.add_argument("--streams", default="1,8,32,64")
    r.add_argument("--server-requests", type=int, default=64)
    r.add_argument("--server-tokens", type=int, default=64)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "prepare":
        return prepare(args)
    if args.command == "install":
        return install(args)
    if args.command == "plan":
        return plan(args)
    for name in ("stages", "methods", "lossless", "sets"):
        setattr(args, name, [v for v in getattr(args, name).split(",") if v])
    unknown = [s for s in args.stages if s not in STAGES]
    if unknown:
        raise SystemExit(f"unknown stage(s) {', '.join(unknown)}; expected some of {', '.join(STAGES)}")
    args.draft = args.draft or None
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
