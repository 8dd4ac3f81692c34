"""The micro-benchmark behind ``--dtype auto`` / ``--draft-quant auto`` / ``--quant auto``: one decoder MLP
projection at 1 and 8 rows per kernel, each kernel cycling through copies of its weight worth twice the L3 so it
streams from memory as a model's weights do; rounds repeated until they agree, and rounds that contradict
themselves (more rows faster than fewer, weights streamed faster than the machine's read bandwidth) rejected.
The choices made from these figures, and their cache: ``sparrow.runtime.hardware``."""

from __future__ import annotations

import functools
import itertools
import math
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from sparrow.runtime import gguf_kernels, onednn
from sparrow.runtime.quant import DynamicInt8Linear, kernel_takes, pack_int4, quantize_int4, quantize_int8

OFF = {"0", "false", "no", "off"}  # environment values that switch a measurement off


BENCH_SHAPE = (8960, 1536)  # [out_features, in_features]: Qwen2.5-1.5B's MLP gate/up projection



BENCH_ROWS = (1, 8)  # a plain decoding step; verifying a draft of 8 tokens



ONEDNN = "float32_onednn"  # the float32 matmul through oneDNN (sparrow.runtime.onednn), beside torch's own



INT4_GROUP_SIZE = 128



GGUF = "gguf"  # the GGUF kernels' row (--quant gguf): Q4_K blocks, as the presets' big linears are, 8-bit activations



GGUF_TYPE = gguf_kernels.Q4_K



MIN_ROUNDS = 2  # consistent rounds that must agree before a measurement is trusted (and cached)



MAX_ROUNDS = 4  # rounds at most; a measurement whose rounds never agreed is used for this process only



STABLE_TOLERANCE = 0.15  # rounds agree when every figure is within 15% of the figures' median



MIN_ROWS_RATIO = 0.8  # 8 rows stream the same weight as 1 row and compute more: below 0.8x its cost is load noise



MAX_BANDWIDTH_RATIO = 2.0  # a kernel implying its weights stream > 2x the measured read bandwidth was mistimed



RECHECK_FASTER = 0.35  # a quick load-time round this much faster than the cached figures: measure again



WEIGHT_BYTES = {"float32": 4.0, "float32_onednn": 4.0, "bfloat16": 2.0, "int8": 1.0, "w8a8": 1.0, "int4": 0.5,
                GGUF: 144 / 256}  # Q4_K: 144 bytes a block of 256 weights



DENSE = ("float32", "bfloat16", "float32_onednn")  # the kernels of the quick load-time check



def _time_ms(kernels: dict[str, Callable[[], object]], min_runs: int = 5, min_seconds: float = 0.04,
             max_seconds: float = 0.2) -> dict[str, float]:
    """The fastest run of each kernel, in milliseconds, after two warm-up calls each. The kernels run in turns
    (so a passing load on the machine slows them alike), at least ``min_runs`` times and ``min_seconds`` in
    all; slow kernels stop after ``max_seconds`` (and at least 3 runs). The fastest run, not the median: other
    work on the machine only ever adds time."""
    for fn in kernels.values():
        fn()
        fn()
    times: dict[str, list[float]] = {name: [] for name in kernels}
    start = time.perf_counter()
    for runs in itertools.count(1):
        for name, fn in kernels.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
        spent = time.perf_counter() - start
        if (runs >= min_runs and spent >= min_seconds) or (runs >= 3 and spent >= max_seconds):
            break
    return {name: min(ts) * 1000 for name, ts in times.items()}



def _streams(nbytes: int) -> dict[str, Callable[[], object]]:
    """Kernels that read ``nbytes`` from memory and compute little: a float32 matrix-vector product over a matrix of
    ``nbytes`` and a float32 sum over as many bytes. Timed in turns with the benchmark's kernels, the faster of them
    gives the read bandwidth that their weights' bytes must stay under. Either alone fell short on some machine:
    reductions such as ``amax`` ran 7x below the bandwidth on one Zen 5 VM, and on another (2 cores) the
    matrix-vector product read 21-23 GB/s where ``sum`` read 68 GB/s and oneDNN's one-row float32 linear streamed
    its weights at 44-49 GB/s, so every round of a quiet machine was rejected."""
    matrix = torch.ones(max(1, nbytes // 4096), 1024, dtype=torch.float32)
    vector = torch.ones(1024, dtype=torch.float32)
    return {"stream_mv": functools.partial(torch.mv, matrix, vector),
            "stream_sum": functools.partial(torch.sum, matrix)}



def cache_bytes() -> int:
    """The CPU's largest cache (its L3), from sysfs; 32 MiB where it does not say."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = path.read_text().strip().upper()
            sizes.append(int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1:], 0))
        except (OSError, ValueError):
            continue
    return max(sizes, default=32 << 20)



def _copies(make: Callable[[], tuple], nbytes: int, working_set: int) -> Iterator[tuple]:
    """Enough copies of a kernel's weights (``make()``, ``nbytes`` each) to fill ``working_set``, in turns: a
    weight that fits in the cache would be timed at cache speed, a real model's weights stream from memory."""
    return itertools.cycle([make() for _ in range(max(1, math.ceil(working_set / nbytes)))])



def gguf_blocks(qtype: int, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Valid GGUF blocks of type ``qtype`` for a [rows, cols] weight, as uint8 [rows, row bytes]: random bytes with
    finite fp16 scales (1e-3). The kernels' speed does not depend on the values."""
    values, nbytes = gguf_kernels.BLOCKS[qtype]
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (rows * cols // values, nbytes), dtype=torch.uint8, generator=generator)
    scale = torch.full((len(blocks), 1), 1e-3, dtype=torch.float16).view(torch.uint8)
    for offset in gguf_kernels.SCALE_OFFSETS[qtype]:
        blocks[:, offset:offset + 2] = scale
    return blocks.reshape(rows, -1)



def gguf_measurable(shape: tuple[int, int]) -> bool:
    """Whether ``measure`` times the GGUF kernel (``GGUF``) at ``shape``: the in_features are whole Q4_K blocks and
    the kernels are built (``gguf_kernels.available()``; the shape is checked first, so a shape they cannot take
    never builds them)."""
    return shape[1] % gguf_kernels.BLOCKS[GGUF_TYPE][0] == 0 and gguf_kernels.available()



def measure(rows: tuple[int, ...] = BENCH_ROWS, shape: tuple[int, int] = BENCH_SHAPE, *, quant: bool = True,
            working_set: int | None = None) -> dict[str, object]:
    """Milliseconds per ``x @ W.T`` with W of ``shape``, x of ``rows`` rows, on the CPU with torch's threads:
    ``{"float32": {"1": ms, "8": ms}, "bfloat16": {...}, "float32_onednn": {...}, "int8": {...}, "int4": {...},
    "w8a8": {...}, "gguf": {...}}`` (float32_onednn where this torch has oneDNN's linear; gguf where the GGUF
    kernels are built, see ``gguf_measurable``). The weight-only kernels compute in the dtype picked from the first
    two (as a quantized draft would), named by ``quant_activations``; w8a8 (int8 weights and per-token int8
    activations, fbgemm) takes that dtype too. gguf: ``sparrow.runtime.gguf_kernels``' matmul on Q4_K blocks with
    8-bit activations, packed where GGUFLinear packs them (what ``--quant gguf`` runs the presets' big linears with),
    float32 activations in."""

    start = time.perf_counter()
    out_features, in_features = shape
    generator = torch.Generator().manual_seed(0)
    costs: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        weight = torch.randn(out_features, in_features, generator=generator) * 0.02
        inputs = {n: torch.randn(n, in_features, generator=generator) for n in rows}

        probes: dict[str, float] = {}

        def timed(kernels: dict[str, tuple[Callable[[torch.Tensor], object], torch.dtype]],
                  extra: dict[str, Callable[[], object]] | None = None) -> None:
            """Time ``kernels`` (name -> (kernel, activation dtype)) in turns, at each row count, into ``costs``
            (and the argument-less ``extra`` kernels in the same turns at the first row count, into ``probes``)."""
            for i, n in enumerate(rows):
                fns = {name: functools.partial(kernel, inputs[n].to(dtype))
                       for name, (kernel, dtype) in kernels.items()}
                ms = _time_ms({**fns, **(extra if extra and i == 0 else {})})
                for name, cost in ms.items():
                    if name in fns:
                        costs.setdefault(name, {})[str(n)] = cost
                    else:
                        probes[name] = cost

        # by default 2x the L3 (64 MiB-512 MiB) of distinct weights per kernel, used in turns (see _copies)
        working_set = working_set or min(max(2 * cache_bytes(), 64 << 20), 512 << 20)
        size = out_features * in_features
        dense = {torch.float32: _copies(lambda: (weight.clone(),), 4 * size, working_set),
                 torch.bfloat16: _copies(lambda: (weight.to(torch.bfloat16),), 2 * size, working_set)}
        kernels = {dtype_name(dtype): (lambda x, w=w: torch.nn.functional.linear(x, *next(w)), dtype)
                   for dtype, w in dense.items()}
        if onednn.available():
            kernels[ONEDNN] = (lambda x, w=dense[torch.float32]: onednn.linear(x, next(w)[0], None), torch.float32)
        timed(kernels, _streams(working_set))
        bandwidth = max(1, working_set // 4096) * 4096 / (min(probes.values()) / 1000) / 1e9
        dense.clear()  # free them before the quantized copies are made
        act = torch.bfloat16 if faster_dense(costs) >= MIN_BF16_SPEEDUP else torch.float32  # what auto picks
        cpu = torch.device("cpu")
        quantized: dict[str, tuple[Callable[[torch.Tensor], object], torch.dtype]] = {}
        if quant and kernel_takes(8, out_features, in_features, INT4_GROUP_SIZE, cpu):
            q8, scales = quantize_int8(weight)
            w8 = _copies(lambda: (q8.clone(), scales.to(act)), size, working_set)
            quantized["int8"] = (lambda x: torch.ops.aten._weight_int8pack_mm(x, *next(w8)), act)
        if quant and kernel_takes(4, out_features, in_features, INT4_GROUP_SIZE, cpu):
            q4, scales_zeros = quantize_int4(weight, INT4_GROUP_SIZE)
            p4 = pack_int4(q4, cpu)
            w4 = _copies(lambda: (p4.clone(), INT4_GROUP_SIZE, scales_zeros.to(act)), size // 2, working_set)
            quantized["int4"] = (lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, *next(w4)), act)
        if quant:
            q8, scales = quantize_int8(weight)
            linears = _copies(lambda: (DynamicInt8Linear(in_features, out_features, q8, scales, None, True),),
                              size, working_set)
            quantized["w8a8"] = (lambda x: next(linears)[0](x), act)
        if quant and gguf_measurable(shape):
            # in the layout GGUFLinear runs it in
            blocks, kind = gguf_kernels.kernel_blocks(gguf_blocks(GGUF_TYPE, out_features, in_features), GGUF_TYPE,
                                                      out_features, in_features)
            wq = _copies(lambda: (blocks.clone(),), blocks.numel(), working_set)
            quantized[GGUF] = (lambda x: gguf_kernels.matmul(x, next(wq)[0], kind, out_features, True),
                               torch.float32)
        if quantized:
            timed(quantized)
    return {"costs": costs, "quant_activations": dtype_name(act), "unit": "ms per matmul", "shape": list(shape),
            "bandwidth_gbs": round(bandwidth, 2), "seconds": round(time.perf_counter() - start, 3)}



def inconsistencies(result: dict[str, object], bandwidth: float | None = None) -> list[str]:
    """Why one round of ``measure`` cannot be true ([] where nothing is wrong): a kernel that ran more rows in
    less time than fewer (below ``MIN_ROWS_RATIO``; they stream the same weight), or that read its weights
    faster than ``MAX_BANDWIDTH_RATIO`` x the memory bandwidth (default: the one measured in the same round;
    ``measure_stable`` passes the best of its rounds, as a busy round measures the bandwidth low too)."""
    costs: dict[str, dict[str, float]] = result["costs"]  # type: ignore[assignment]
    shape = result.get("shape") or list(BENCH_SHAPE)
    bandwidth = bandwidth if bandwidth is not None else result.get("bandwidth_gbs")
    problems = []
    for name, row in costs.items():
        counts = sorted(row, key=int)
        for fewer, more in zip(counts, counts[1:]):
            if row[more] < MIN_ROWS_RATIO * row[fewer]:
                problems.append(f"{name}: {more} rows {row[more]:.2f} ms < {fewer} row{'s' * (fewer != '1')} "
                                f"{row[fewer]:.2f} ms")
        if isinstance(bandwidth, (int, float)) and bandwidth > 0 and name in WEIGHT_BYTES:
            implied = shape[0] * shape[1] * WEIGHT_BYTES[name] / (min(row.values()) / 1000) / 1e9
            if implied > MAX_BANDWIDTH_RATIO * bandwidth:
                problems.append(f"{name}: {implied:.0f} GB/s of weights > {MAX_BANDWIDTH_RATIO:g}x the measured "
                                f"{bandwidth:.0f} GB/s")
    return problems



def spread(rounds: list[dict[str, dict[str, float]]]) -> float:
    """The largest (max - min) / median of any figure over ``rounds`` (costs dicts); 0 for one round."""
    worst = 0.0
    for name, row in rounds[0].items():
        for n in row:
            values = sorted(r[name][n] for r in rounds if name in r and n in r[name])
            worst = max(worst, (values[-1] - values[0]) / values[len(values) // 2])
    return worst



def _median_costs(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    def median(values: list[float]) -> float:
        values = sorted(values)
        mid = len(values) // 2
        return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2

    return {name: {n: median([r[name][n] for r in rounds]) for n in row} for name, row in rounds[0].items()}



def measure_stable(measure_fn: Callable[..., dict[str, object]] | None = None, *, min_rounds: int = MIN_ROUNDS,
                   max_rounds: int = MAX_ROUNDS, tolerance: float = STABLE_TOLERANCE) -> dict[str, object]:
    """``measure`` repeated until the last ``min_rounds`` consistent rounds (see ``inconsistencies``; with the
    same activation dtype) agree within ``tolerance`` (see ``spread``), at most ``max_rounds`` rounds. Returns the
    medians of the agreeing rounds as ``costs`` (None when every round was rejected) and ``stability``:
    ``{"stable", "rounds", "used", "spread", "tolerance", "rejected": [why, ...]}``."""
    measure_fn = measure_fn or measure  # looked up now: the tests replace hardware.measure
    start = time.perf_counter()
    good: list[dict[str, object]] = []
    rejected: list[str] = []
    used: list[dict[str, object]] = []
    stable, rounds, bandwidth = False, 0, 0.0
    for rounds in range(1, max_rounds + 1):
        result = measure_fn()
        if isinstance(result.get("bandwidth_gbs"), (int, float)):
            bandwidth = max(bandwidth, float(result["bandwidth_gbs"]))  # type: ignore[arg-type]
        problems = inconsistencies(result, bandwidth or None)
        if problems:
            rejected.append("; ".join(problems))
            continue
        good.append(result)
        used = [r for r in good if r["quant_activations"] == result["quant_activations"]]
        if len(used) >= min_rounds and spread([r["costs"] for r in used[-min_rounds:]]) <= tolerance:
            used, stable = used[-min_rounds:], True
            break
    stability = {"stable": stable, "rounds": rounds, "used": len(used), "tolerance": tolerance,
                 "spread": round(spread([r["costs"] for r in used]), 4) if used else None, "rejected": rejected}
    seconds = round(time.perf_counter() - start, 3)
    if not used:
        return {"costs": None, "stability": stability, "seconds": seconds}
    return {**used[-1], "costs": _median_costs([r["costs"] for r in used]), "stability": stability,
            "bandwidth_gbs": round(bandwidth, 2) if bandwidth else None, "seconds": seconds}



def recheck(record: dict[str, object], measure_fn: Callable[..., dict[str, object]] | None = None
            ) -> dict[str, object]:
    """One quick dense-only round against a cached ``record``: ``{"ratio", "agreed"}``, ratio = the smallest
    (new / cached) cost of any dense figure. It agrees unless it ran ``RECHECK_FASTER`` faster (a slower check
    says only that the machine is busy now); an inconsistent check is ignored (ratio None, agreed)."""
    check = (measure_fn or measure)(quant=False)
    if inconsistencies(check):
        return {"ratio": None, "agreed": True}
    cached: dict[str, dict[str, float]] = record["costs"]  # type: ignore[assignment]
    ratios = [cost / cached[name][n] for name, row in check["costs"].items() if name in DENSE and name in cached
              for n, cost in row.items() if n in cached[name]]
    if not ratios:
        return {"ratio": None, "agreed": True}
    ratio = min(ratios)
    return {"ratio": round(ratio, 3), "agreed": ratio >= 1 - RECHECK_FASTER}


MIN_BF16_SPEEDUP = 1.1  # bfloat16 is picked over float32 only when at least this much faster



MIN_ONEDNN_SPEEDUP = 1.1  # float32 models route their linears through oneDNN only when at least this much faster



def onednn_speedup(costs: dict[str, dict[str, float]]) -> float:
    """How many times faster float32 ran through oneDNN than through torch's linear, over all row counts (0: not
    measured)."""
    return sum(costs["float32"].values()) / sum(costs[ONEDNN].values()) if ONEDNN in costs else 0.0



def onednn_enabled() -> bool:
    return os.environ.get("SPARROW_ONEDNN", "1").strip().lower() not in OFF



def dense_costs(costs: dict[str, dict[str, float]], name: str) -> dict[str, float]:
    """The costs of the path a dense `name` ("float32" / "bfloat16") model runs: float32 through oneDNN where
    that measured faster (``load_model`` routes it there, unless SPARROW_ONEDNN=0)."""
    faster = onednn_enabled() and onednn_speedup(costs) >= MIN_ONEDNN_SPEEDUP
    return costs[ONEDNN] if name == "float32" and faster else costs[name]



def faster_dense(costs: dict[str, dict[str, float]]) -> float:
    """How many times faster bfloat16 ran than float32 (its faster path), over all measured row counts."""
    return sum(dense_costs(costs, "float32").values()) / sum(costs["bfloat16"].values())



def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

