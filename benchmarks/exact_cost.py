"""Median seconds of a one-token step and an 8-token verify forward, exact on vs off (alternating), bf16."""

import statistics
import sys
import time

import torch

from sparrow.models import load_model
from sparrow.runtime.batch_invariant import exact_copy
from sparrow.runtime.runner import runner_for
from sparrow.types import Prompt

torch.set_num_threads(2)
loaded = load_model(sys.argv[1], dtype="bfloat16", device="cpu", progress=False)
models = {False: loaded.model, True: exact_copy(loaded.model)}
text = open(__import__("sparrow.pipeline").pipeline.__file__).read()
for ctx in (int(a) for a in sys.argv[2:]):
    ids = torch.tensor(loaded.tokenizer(text)["input_ids"][: ctx + 8])
    runners = {e: runner_for(m) for e, m in models.items()}
    for r in runners.values():
        r.prefill(Prompt(input_ids=ids[:ctx]))
    times = {(e, k): [] for e in (False, True) for k in (1, 8)}
    for rep in range(6):
        for e, r in runners.items():
            for k in (1, 8):
                t = time.perf_counter()
                r.forward(ids[ctx : ctx + k])
                times[(e, k)].append(time.perf_counter() - t)
                r.rewind(ctx)
    for k in (1, 8):
        off, on = statistics.median(times[(False, k)]), statistics.median(times[(True, k)])
        print(
            f"ctx {ctx} rows {k}: exact off {off * 1e3:.1f} ms, on {on * 1e3:.1f} ms, on/off {on / off:.3f}  "
            f"(off {sorted(round(x * 1e3) for x in times[(False, k)])}, "
            f"on {sorted(round(x * 1e3) for x in times[(True, k)])})",
            flush=True,
        )
