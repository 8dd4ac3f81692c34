"""Do a compiled target's verify rows equal its one-row steps? (`sparrow.runtime.compiled`, "Exact rows")

Loads a preset's quantized copy, compiles its static-cache steps, prefills a code prompt, then runs the next k
tokens once as one k-row forward and once as k one-row forwards, and prints the largest logit difference for
k = 2, 4, 8, 16, with the compiled steps' row-invariant inductor options (`INVARIANT_OPTIONS`, the default) or
without (`--no-invariant`), and a one-row step's time. Not a test: it needs the preset's weights and minutes of
compiling.

    PYTHONPATH=src python benchmarks/compiled_rows.py --target qwen2.5-coder-1.5b --quant int4 [--no-invariant]
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

import sparrow
from sparrow.runtime import compiled
from sparrow.types import Prompt

PROMPT = 'def is_prime(n):\n    """Return True if n is prime."""\n    if n < 2:\n        return False\n'


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--quant", default="int4")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--invariant", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    compiled.INVARIANT_ROWS = args.invariant
    pipe = sparrow.load(args.target, drafter="prompt-lookup", quant=args.quant, dtype=args.dtype, exact=False)
    runner = compiled.StaticCachedModel(pipe.target.model, compile=True)
    ids = torch.tensor(pipe.tokenizer(PROMPT)["input_ids"])
    n = ids.numel() - 16
    with torch.inference_mode():
        runner.prefill(Prompt(ids[:n]))
        for k in (2, 4, 8, 16):
            runner.rewind(n)
            block = runner.forward(ids[n:n + k]).logits.float()
            runner.rewind(n)
            rows = torch.cat([runner.forward(ids[n + i:n + i + 1]).logits.float() for i in range(k)])
            print(f"{k} rows: max |k-row forward - one-row steps| = {(block - rows).abs().max().item():.4g} "
                  f"(argmax equal: {torch.equal(block.argmax(-1), rows.argmax(-1))})")
        times = []
        for _ in range(20):
            runner.rewind(n)
            t0 = time.perf_counter()
            runner.forward(ids[n:n + 1])
            times.append(time.perf_counter() - t0)
    print(f"one-row step: median {sorted(times)[10] * 1e3:.1f} ms; {args.target} {args.quant} {args.dtype}, "
          f"invariant options: {args.invariant}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")


if __name__ == "__main__":
    main()
