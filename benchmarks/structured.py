"""JSON extraction with structured output: constrained plain decoding against constrained speculative decoding.

    nice -n 10 python benchmarks/structured.py --target smollm2-135m --drafters prompt-lookup
    nice -n 10 python benchmarks/structured.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
        --drafters draft-model prompt-lookup --repeats 1

Each case: a short text and a JSON schema; the chat prompt asks for the facts of the text as JSON. Per case and
method: tokens/s (decode + prefill, as `GenerationResult.tokens_per_second`), whether the output is valid JSON
that keeps to the schema (`jsonschema`), whether the speculative output equals the constrained plain one token for
token, tokens per target forward, and the grammar's CPU time per generated token as a share of the plain decode
CPU time per token (≈ one target forward). CPU times (process / thread CPU seconds) are given beside wall
times because the machine is shared: wall time under contention is inflated by other users. One JSON row per
line, then a summary.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import jsonschema
import torch

import sparrow
from sparrow.drafters import build_drafter
from sparrow.pipeline import Pipeline

PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "city": {"type": "string"}, "occupation": {"type": "string"}},
    "required": ["name", "age", "city", "occupation"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {
    "order_id": {"type": "string"}, "customer": {"type": "string"},
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "product": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1}},
        "required": ["product", "quantity"], "additionalProperties": False}},
    "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]}},
    "required": ["order_id", "customer", "items", "status"], "additionalProperties": False}
EVENT = {"type": "object", "properties": {
    "title": {"type": "string"}, "date": {"type": "string"}, "location": {"type": "string"},
    "speakers": {"type": "array", "items": {"type": "string"}},
    "price_eur": {"type": "number", "minimum": 0}},
    "required": ["title", "date", "location", "speakers", "price_eur"], "additionalProperties": False}
CASES = [
    ("person", PERSON, ("Maria Gonzalez is a 34-year-old software engineer who lives in Barcelona. She moved there "
                        "from Madrid in 2015 and works for a robotics start-up.")),
    ("order", ORDER, ("Order A-10293 was placed by Jonathan Smith on Monday. It contains 2 copies of The Pragmatic "
                      "Programmer, 1 USB-C charging cable and 3 packs of printer paper. The parcel has shipped and "
                      "should arrive on Thursday.")),
    ("event", EVENT, ("The Applied Machine Learning Summit takes place on 2026-03-14 at the Berlin Congress Center. "
                      "Talks by Dr. Aisha Khan and Prof. Lars Eriksson. Tickets cost 149.50 EUR.")),
]


def prompt_of(text: str, schema: dict) -> str:
    return (f"Extract the facts of this text as JSON with the keys {', '.join(schema['properties'])}.\n\n"
            f"Text: {text}\n\nAnswer with the JSON object only.")


class Recording(Pipeline):
    def constraint(self, request):
        self.last = super().constraint(request)
        return self.last


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="qwen2.5-coder-0.5b")
    parser.add_argument("--drafters", nargs="+", default=["prompt-lookup"])
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--draft", default=None, help="draft model preset for --drafters draft-model")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)  # a shared CPU: spinning threads of several processes cost 10-40x
    print(f"# {platform.machine()} threads={torch.get_num_threads()} target={args.target} float32 "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    base = sparrow.load(args.target, drafter="none", dtype="float32")
    pipes = {"plain": Recording(base.target, None)}
    draft = sparrow.load(args.draft, drafter="none", dtype="float32").target if args.draft else None
    for name in args.drafters:
        pipes[name] = Recording(base.target, build_drafter(name, base.target, draft, None, adaptive=True))
    for pipe in pipes.values():  # warm-up: one-time costs (allocator, the grammar's tokenizer view)
        pipe.generate("Hello", max_new_tokens=4, chat=True, json_schema=PERSON)
    summary: dict[str, list] = {name: [] for name in pipes}
    for case, schema, text in CASES:
        options = {"max_new_tokens": args.max_new_tokens, "chat": True, "json_schema": schema}
        reference = None
        for name, pipe in pipes.items():
            for _ in range(args.repeats):
                cpu = time.process_time()
                run = pipe.generate(prompt_of(text, schema), **options) if name != "plain" else \
                    pipe.generate_plain(prompt_of(text, schema), **options)
                reference = run if name == "plain" and reference is None else reference
                cpu = time.process_time() - cpu
                grammar_per_token = pipe.last.seconds / max(run.new_tokens, 1)
                row = {"case": case, "method": name, "tokens": run.new_tokens, "finish": run.finish_reason,
                       "tok_s": round(run.tokens_per_second, 2), "seconds": round(run.seconds, 3),
                       "cpu_seconds": round(cpu, 3),
                       "valid": valid(run.text, schema), "identical": run.token_ids == reference.token_ids,
                       "tokens_per_forward": round(run.stats.mean_accepted_tokens, 2),
                       "grammar_ms_per_token": round(1e3 * grammar_per_token, 3),
                       "forced": pipe.last.forced, "text": run.text}
                summary[name].append(row)
                print(json.dumps(row), flush=True)
    plain_rate = statistics.mean(r["tok_s"] for r in summary["plain"])
    plain_cpu = statistics.mean(r["cpu_seconds"] / r["tokens"] for r in summary["plain"])  # ~ one forward + grammar
    plain_grammar = statistics.mean(r["grammar_ms_per_token"] for r in summary["plain"]) / 1e3
    for name, rows in summary.items():
        rate = statistics.mean(r["tok_s"] for r in rows)
        grammar = statistics.mean(r["grammar_ms_per_token"] for r in rows) / 1e3
        cpu_rate = sum(r["tokens"] for r in rows) / sum(r["cpu_seconds"] for r in rows)
        plain_cpu_rate = sum(r["tokens"] for r in summary["plain"]) / sum(r["cpu_seconds"] for r in summary["plain"])
        print(json.dumps({"method": name, "mean_tok_s": round(rate, 2), "speedup": round(rate / plain_rate, 2),
                          "speedup_cpu_time": round(cpu_rate / plain_cpu_rate, 2),
                          "valid": f"{sum(r['valid'] for r in rows)}/{len(rows)}",
                          "identical": f"{sum(r['identical'] for r in rows)}/{len(rows)}",
                          "grammar_cpu_ms_per_token": round(1e3 * grammar, 3),
                          "grammar_share_of_a_forward": round(grammar / (plain_cpu - plain_grammar), 4)}))


if __name__ == "__main__":
    main()
