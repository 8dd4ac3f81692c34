"""Agentic-style workload: suffix decoding against prompt lookup and plain decoding, from offline text.

The workload (built by `build_workload` from sparrow's own source files, nothing downloaded) is a sequence of
requests as an agent sends them, in order, to one model:

* file-edits: multi-turn edits of one file: each turn gives the current file (the previous turn's answer) and
  asks for a small change, answered with the whole file;
* tool-calls: the same tool schema, one JSON tool call per request for a series of similar tasks;
* doc-regen: one document regenerated with a small change each time.

Every method gets its own pipeline (its own suffix store, empty at the start) over one loaded target, and the
requests run interleaved (request i for every method, then request i + 1), so machine noise hits the methods
alike. Outputs are compared with plain decoding's token for token.

    PYTHONPATH=src nice -n 10 python benchmarks/agentic.py --target smollm2-135m --dtype float32 \
        --out benchmarks/results/suffix_agentic.jsonl
    PYTHONPATH=src python benchmarks/agentic.py --micro      # the suffix structure's per-token costs

`--baseline REF` adds "suffix@REF": the suffix drafter as committed at git REF (its module read from git), in the
same process and interleaved like the others, for before/after comparisons on a noisy machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMIT = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                        text=True).stdout.strip()
METHODS = ("plain", "prompt-lookup", "suffix")


@dataclass(frozen=True)
class Request:
    kind: str
    prompt: str  # may hold "{previous}": the previous answer of the same kind (a multi-turn edit)


def _source(relative: str, start: str, lines: int) -> str:
    """`lines` lines of a source file of this repository, from the first line that starts with `start`."""
    text = (ROOT / relative).read_text().splitlines()
    first = next(i for i, line in enumerate(text) if line.startswith(start))
    return "\n".join(text[first:first + lines])


TOOLS = json.dumps([
    {"name": "read_file", "parameters": {"path": "string", "start_line": "integer", "end_line": "integer"}},
    {"name": "search_code", "parameters": {"query": "string", "path": "string", "max_results": "integer"}},
    {"name": "edit_file", "parameters": {"path": "string", "old_text": "string", "new_text": "string"}},
], indent=1)
TASKS = [("read lines 1 to 40 of src/sparrow/tree.py", "read_file"),
         ("read lines 40 to 80 of src/sparrow/tree.py", "read_file"),
         ("search for 'def merge_paths' in src/sparrow", "search_code"),
         ("search for 'class TreeLayout' in src/sparrow", "search_code"),
         ("read lines 80 to 120 of src/sparrow/engine.py", "read_file"),
         ("search for 'def speculative_decode' in src/sparrow", "search_code")]
EDITS = ["Rename the function `merge_paths` to `merge_sequences`.",
         "Rename the variable `tokens` to `ids` everywhere.",
         "Rename the variable `index` to `lookup`.",
         "Rename the function `path_to` to `root_path`."]
CHANGES = [("drafter", "proposer"), ("target", "verifier model"), ("round", "step"), ("token", "piece")]


def build_workload() -> list[Request]:
    """The requests, in the order an agent sends them (file edits, tool calls and document rewrites interleaved)."""
    code = _source("src/sparrow/tree.py", "def path_to", 10) + "\n\n\n" + _source("src/sparrow/tree.py",
                                                                                    "def merge_paths", 20)
    doc = _source("src/sparrow/decoding/engine.py", "def speculative_decode", 12)
    requests = []
    for turn in range(4):
        current = code if turn == 0 else "{previous}"
        requests.append(Request("file-edits", f"Here is the file tree.py:\n```python\n{current}\n```\n{EDITS[turn]} "
                                              "Reply with the complete updated file only, in a ```python block."))
        for task, _ in TASKS[turn * 3 // 2: (turn + 1) * 3 // 2]:
            requests.append(Request("tool-calls", f"You are a coding agent. Tools:\n{TOOLS}\nTask: {task}.\n"
                                                  'Answer with exactly one tool call as JSON: {"name": ..., '
                                                  '"arguments": {...}}.'))
        old, new = CHANGES[turn]
        requests.append(Request("doc-regen", f"Rewrite the following text, replacing the word '{old}' by '{new}'. "
                                             f"Output the full rewritten text only.\n\n{doc}"))
    return requests


def extract_file(answer: str) -> str:
    """The code block of an answer (the whole answer without one)."""
    if "```" not in answer:
        return answer
    body = answer.split("```", 2)[1]
    return body.split("\n", 1)[1] if "\n" in body else body


def suffix_at(ref: str):
    """The `sparrow.drafters.suffix` module as committed at git `ref` (it imports today's other modules)."""
    source = subprocess.run(["git", "show", f"{ref}:src/sparrow/drafters/suffix.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    spec = importlib.util.spec_from_loader(f"suffix_at_{ref}", loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    exec(compile(source, f"{ref}:suffix.py", "exec"), module.__dict__)
    return module


def run(args: argparse.Namespace) -> list[dict]:
    import torch

    import sparrow
    from sparrow.models import load_model

    torch.set_num_threads(args.threads)
    target = load_model(args.target, dtype=args.dtype, progress=False)
    prefix = args.prefix_cache
    pipes = {m: sparrow.load(target, drafter="none" if m == "plain" else m, draft=None, prefix_cache=prefix)
             for m in METHODS}
    for name, options in json.loads(args.variants).items():  # e.g. {"suffix-f2": {"max_spec_factor": 2.0}}
        options = {"drafter": "suffix", **options}  # another drafter: {"lookup-k24": {"drafter": "prompt-lookup", ...}}
        pipes[name] = sparrow.load(target, draft=None, prefix_cache=prefix, **options)
    if args.baseline:
        from sparrow.pipeline import Pipeline

        pipes[f"suffix@{args.baseline}"] = Pipeline(target, suffix_at(args.baseline).build(target, None, 16, True),
                                                    prefix_cache=prefix)
    pipes["plain"].generate_plain("Hello", max_new_tokens=4)  # warm-up
    rows = []
    previous: dict[str, str] = {}
    for i, request in enumerate(build_workload()):
        prompt = request.prompt.replace("{previous}", extract_file(previous.get(request.kind, "")))
        plain_ids = None
        for method, pipe in pipes.items():
            run_ = pipe.generate_plain if method == "plain" else pipe.generate
            result = run_(prompt, max_new_tokens=args.max_new_tokens, chat=True)
            if method == "plain":
                plain_ids = result.token_ids
                previous[request.kind] = result.text
            rows.append({"request": i, "kind": request.kind, "method": method, "new_tokens": result.new_tokens,
                         "seconds": result.seconds, "tokens_per_second": result.tokens_per_second,
                         "mean_accepted_tokens": result.stats.mean_accepted_tokens if method != "plain" else None,
                         "identical": result.token_ids == plain_ids, "repeat": args.repeat, "run": args.run,
                         "target": args.target, "commit": COMMIT,
                         "prefill_seconds": result.stats.prefill_seconds, "prefix_cache": prefix,
                         "reused_prompt_tokens": pipe.runner.reused})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def summarize(rows: list[dict]) -> str:
    """Markdown: per kind and in all, each method's tokens per second (total tokens / total seconds) and speedup."""
    kinds = [*dict.fromkeys(r["kind"] for r in rows), "all"]
    lines = ["| method | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]

    def rate(method: str, kind: str) -> float:
        group = [r for r in rows if r["method"] == method and kind in ("all", r["kind"])]
        return sum(r["new_tokens"] for r in group) / sum(r["seconds"] for r in group)

    for method in dict.fromkeys(r["method"] for r in rows):
        cells = []
        for kind in kinds:
            cell = f"{rate(method, kind):.1f} tok/s"
            if method != "plain":
                group = [r for r in rows if r["method"] == method and kind in ("all", r["kind"])]
                accepted = statistics.mean(r["mean_accepted_tokens"] or 0 for r in group)
                cell += (f", **{rate(method, kind) / rate('plain', kind):.2f}x** plain, "
                         f"{rate(method, kind) / rate('prompt-lookup', kind):.2f}x lookup, {accepted:.2f} acc/step, "
                         f"identical {sum(r['identical'] for r in group)}/{len(group)}")
            cells.append(cell)
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def micro(args: argparse.Namespace) -> None:
    """The suffix structure's costs: appending a token, and one propose, against a one-token target forward."""
    import torch

    from sparrow.config import SamplingConfig
    from sparrow.drafters.suffix import SuffixDrafter
    from sparrow.drafters.suffix_tree import SuffixTrie
    from sparrow.types import Prompt

    g = torch.Generator().manual_seed(0)
    text = (ROOT / "src/sparrow/pipeline.py").read_text().encode()  # a source file of over 8000 bytes
    ids = list(text[:8000])  # bytes as token ids: real text, a vocabulary of 256
    noise = torch.randint(0, 50_000, (8000,), generator=g).tolist()  # novel text: a node per suffix
    for name, seq in (("source text", ids), ("random ids", noise)):
        trie = SuffixTrie(24)
        start = time.perf_counter()
        trie.extend(0, seq)
        per_token = (time.perf_counter() - start) / len(seq)
        print(f"{name}: append {per_token * 1e6:.1f} us/token, {trie.nodes / len(seq):.1f} nodes/token (depth 24)")
    drafter = SuffixDrafter(16)
    drafter.prefill(Prompt(torch.tensor(ids[:4000])))
    times = []
    for n in range(4000, 4400):
        start = time.perf_counter()
        drafter.propose(torch.tensor(ids[:n]), 16, SamplingConfig(), g)
        times.append(time.perf_counter() - start)
    print(f"propose (4000-token context, 16 tokens): median {statistics.median(times) * 1e3:.2f} ms, "
          f"p90 {sorted(times)[int(0.9 * len(times))] * 1e3:.2f} ms")
    if args.target:
        from sparrow.models import load_model
        from sparrow.runtime.runner import runner_for

        torch.set_num_threads(args.threads)
        runner = runner_for(load_model(args.target, dtype=args.dtype, progress=False).model)
        runner.prefill(Prompt(torch.tensor([1] * 64)))
        steps = []
        for _ in range(20):
            start = time.perf_counter()
            runner.forward(torch.tensor([2]))
            steps.append(time.perf_counter() - start)
            runner.rewind(64)
        print(f"{args.target} {args.dtype} one-token forward: median {statistics.median(steps) * 1e3:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variants", default="{}",
                        help='More pipelines: {"name": {options}} (suffix unless the options name a "drafter").')
    parser.add_argument("--baseline", default=None, help="Also run the suffix drafter as committed at this git ref.")
    parser.add_argument("--prefix-cache", type=int, default=0,
                        help="Every pipeline keeps the KV of this many tokens of earlier requests (0: off).")
    parser.add_argument("--run", default=None, help="A label recorded in the rows.")
    parser.add_argument("--repeat", type=int, default=0, help="Recorded in the rows (to tell runs apart).")
    parser.add_argument("--out", type=Path, default=None, help="Append the rows (JSONL) here.")
    parser.add_argument("--summary", type=Path, default=None, help="Only print the table of these JSONL rows.")
    parser.add_argument("--micro", action="store_true", help="Only time the suffix structure (and --target's step).")
    args = parser.parse_args()
    if args.micro:
        micro(args)
        return
    if args.summary:
        from sparrow.bench.report import read_jsonl  # plain or gzipped rows (benchmarks/results keeps them gzipped)

        rows = [json.loads(line) for line in read_jsonl(args.summary) if line.strip()]
    else:
        rows = run(args)
    if args.out and not args.summary:
        with args.out.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(summarize(rows))


if __name__ == "__main__":
    main()
