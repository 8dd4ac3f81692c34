"""What this machine computes fast, and the dtype ``--dtype auto`` picks from it.

* CPU: the instruction-set flags of ``/proc/cpuinfo`` (``avx512_bf16``, ``amx_bf16``, ``avx512_vnni``, ...),
  and a short micro-benchmark: one decoder MLP projection (a 1536 x 8960 weight, Qwen2.5-1.5B's) applied to
  1 row (a plain decoding step) and to 8 rows (verifying a draft), in float32 (torch's linear and oneDNN's,
  ``sparrow.runtime.onednn``) and bfloat16, then with int8 and int4 weight-only weights and w8a8
  (``sparrow.models.quantization``'s kernels) in the dtype picked, each kernel cycling through copies of its weight
  worth twice the L3, so they stream from memory as a model's weights do. It takes about 0.6 s (3 s on an
  AVX2-only CPU) on 2 cores and is cached per machine in ``<cache>/hardware/`` (keyed by CPU model, flags,
  threads and torch version), so it runs once (``sparrow doctor --refresh`` measures again).
* CUDA: the compute capability (native bfloat16 from 8.0, Ampere).

``choose_dtype(device)`` then picks:

* CPU: bfloat16 when the benchmark measured it clearly faster than float32 (``MIN_BF16_SPEEDUP``: bfloat16
  costs exactness, so it has to pay), with bf16 instructions or without them: without them torch converts to
  float32 inside its kernels, which was no faster than float32 on an AVX-512/VNNI Xeon but 2.5x faster for one
  row on an AVX2-only AMD EPYC (half the bytes to stream). With the benchmark disabled (``benchmark=False`` or
  ``SPARROW_DTYPE_BENCHMARK=0``) and nothing cached, the flags alone decide: bfloat16 with bf16 instructions,
  else float32.
* CUDA: bfloat16 where supported natively, else float16.
* anything else: float32.

``choose_draft_quant(device)`` picks the weight format of a draft model (``--draft-quant auto``, the CLI's
default): the quantized format that ran one row fastest, when it beat the dense dtype by ``MIN_DRAFT_QUANT_SPEEDUP``
(int4 here at 4.4x on an AMD EPYC with avx512_bf16; int8 was ~2.5x faster on an AVX-512/VNNI CPU without bf16),
among the formats measured in the draft's own compute dtype (weight-only kernels with float32 activations ran
4-10x slower than with bfloat16 ones on an AVX2-only CPU).

``choose_onednn(device)`` says whether a float32 model runs its linears through oneDNN (where that measured
faster than torch's linear); float32's cost above is that of the path it runs.

Nothing here assumes one machine: the same code picks bfloat16 on a CPU with ``avx512_bf16`` where bf16 is
2-3x faster, float32 on an AVX-512/VNNI CPU without it where bf16 was no faster than float32, and float32
through oneDNN on an AVX2-only AMD EPYC, where bf16 beat torch's float32 linear (MKL) but not oneDNN's.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import itertools
import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sparrow.paths import atomic_file, default_cache_dir
from sparrow.runtime import onednn
from sparrow.runtime.cpu import BF16_FLAGS, CpuInfo, cpu_info
from sparrow.runtime.devices import resolve_device
from sparrow.runtime.quant import DynamicInt8Linear, kernel_takes, pack_int4, quantize_int4, quantize_int8

FORMAT = 4  # bump when the cached record's layout or the benchmark changes
BENCH_SHAPE = (8960, 1536)  # [out_features, in_features]: Qwen2.5-1.5B's MLP gate/up projection
BENCH_ROWS = (1, 8)  # a plain decoding step; verifying a draft of 8 tokens
MIN_BF16_SPEEDUP = 1.1  # bfloat16 is picked over float32 only when at least this much faster
MIN_DRAFT_QUANT_SPEEDUP = 1.1  # --draft-quant auto quantizes a draft only when one row runs at least this much faster
ONEDNN = "float32_onednn"  # the float32 matmul through oneDNN (sparrow.runtime.onednn), beside torch's own
MIN_ONEDNN_SPEEDUP = 1.1  # float32 models route their linears through oneDNN only when at least this much faster
DRAFT_QUANTS = ("int8", "int4", "w8a8")  # the weight formats --draft-quant auto chooses among (sparrow.models.quantization)
INT4_GROUP_SIZE = 128
_OFF = {"0", "false", "no", "off"}


# --- detection ------------------------------------------------------------------------------------------


def cuda_info(device: torch.device) -> dict[str, object]:
    """Name, compute capability and bfloat16 support of a CUDA device."""
    major, minor = torch.cuda.get_device_capability(device)
    return {"name": torch.cuda.get_device_name(device), "capability": f"{major}.{minor}",
            "bf16": (major, minor) >= (8, 0) and torch.cuda.is_bf16_supported(including_emulation=False)}


# --- the micro-benchmark ---------------------------------------------------------------------------------


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


def _onednn_speedup(costs: dict[str, dict[str, float]]) -> float:
    """How many times faster float32 ran through oneDNN than through torch's linear, over all row counts (0: not
    measured)."""
    return sum(costs["float32"].values()) / sum(costs[ONEDNN].values()) if ONEDNN in costs else 0.0


def _onednn_enabled() -> bool:
    return os.environ.get("SPARROW_ONEDNN", "1").strip().lower() not in _OFF


def _dense(costs: dict[str, dict[str, float]], name: str) -> dict[str, float]:
    """The costs of the path a dense `name` ("float32" / "bfloat16") model runs: float32 through oneDNN where
    that measured faster (``load_model`` routes it there, unless SPARROW_ONEDNN=0)."""
    faster = _onednn_enabled() and _onednn_speedup(costs) >= MIN_ONEDNN_SPEEDUP
    return costs[ONEDNN] if name == "float32" and faster else costs[name]


def _faster_dense(costs: dict[str, dict[str, float]]) -> float:
    """How many times faster bfloat16 ran than float32 (its faster path), over all measured row counts."""
    return sum(_dense(costs, "float32").values()) / sum(costs["bfloat16"].values())


def measure(rows: tuple[int, ...] = BENCH_ROWS, shape: tuple[int, int] = BENCH_SHAPE, *, quant: bool = True,
            working_set: int | None = None) -> dict[str, object]:
    """Milliseconds per ``x @ W.T`` with W of ``shape``, x of ``rows`` rows, on the CPU with torch's threads:
    ``{"float32": {"1": ms, "8": ms}, "bfloat16": {...}, "float32_onednn": {...}, "int8": {...}, "int4": {...},
    "w8a8": {...}}`` (float32_onednn where this torch has oneDNN's linear). The
    weight-only kernels compute in the dtype picked from the first two (as a quantized draft would), named by
    ``quant_activations``; w8a8 (int8 weights and per-token int8 activations, fbgemm) takes that dtype too."""

    start = time.perf_counter()
    out_features, in_features = shape
    generator = torch.Generator().manual_seed(0)
    costs: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        weight = torch.randn(out_features, in_features, generator=generator) * 0.02
        inputs = {n: torch.randn(n, in_features, generator=generator) for n in rows}

        def timed(kernels: dict[str, tuple[Callable[[torch.Tensor], object], torch.dtype]]) -> None:
            """Time ``kernels`` (name -> (kernel, activation dtype)) in turns, at each row count, into ``costs``."""
            for n in rows:
                ms = _time_ms({name: functools.partial(kernel, inputs[n].to(dtype))
                               for name, (kernel, dtype) in kernels.items()})
                for name, cost in ms.items():
                    costs.setdefault(name, {})[str(n)] = cost

        # by default 2x the L3 (64 MiB-512 MiB) of distinct weights per kernel, used in turns (see _copies)
        working_set = working_set or min(max(2 * cache_bytes(), 64 << 20), 512 << 20)
        size = out_features * in_features
        dense = {torch.float32: _copies(lambda: (weight.clone(),), 4 * size, working_set),
                 torch.bfloat16: _copies(lambda: (weight.to(torch.bfloat16),), 2 * size, working_set)}
        kernels = {_name(dtype): (lambda x, w=w: torch.nn.functional.linear(x, *next(w)), dtype)
                   for dtype, w in dense.items()}
        if onednn.available():
            kernels[ONEDNN] = (lambda x, w=dense[torch.float32]: onednn.linear(x, next(w)[0], None), torch.float32)
        timed(kernels)
        dense.clear()  # free them before the quantized copies are made
        act = torch.bfloat16 if _faster_dense(costs) >= MIN_BF16_SPEEDUP else torch.float32  # what auto picks
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
        if quantized:
            timed(quantized)
    return {"costs": costs, "quant_activations": _name(act), "unit": "ms per matmul",
            "shape": list(shape), "seconds": round(time.perf_counter() - start, 3)}


# --- the per-machine cache -------------------------------------------------------------------------------


def cache_key(info: CpuInfo) -> dict[str, object]:
    """What a measurement holds for: another CPU, other flags, thread count or torch measures again."""
    return {"format": FORMAT, "cpu": info.model, "arch": info.arch, "flags": list(info.flags),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "shape": list(BENCH_SHAPE),
            "rows": list(BENCH_ROWS)}


def cache_path(key: dict[str, object], cache_dir: Path | str | None = None) -> Path:
    """Where the measurement for ``key`` is cached: ``<cache_dir or sparrow's cache>/hardware/``, or with no
    ``cache_dir`` the directory ``SPARROW_HARDWARE_CACHE`` names (the tests point it at a private one, which
    subprocesses inherit)."""

    name = f"cpu-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]}.json"
    override = os.environ.get("SPARROW_HARDWARE_CACHE", "").strip()
    if cache_dir is None and override:
        return Path(override).expanduser() / name
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / "hardware" / name


def _valid_costs(costs: object) -> bool:
    def ok(row: object) -> bool:
        return (isinstance(row, dict) and {str(n) for n in BENCH_ROWS} <= row.keys()
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
                        for v in row.values()))

    return isinstance(costs, dict) and ok(costs.get("float32")) and ok(costs.get("bfloat16")) and all(
        ok(row) for row in costs.values())


def read_cached(path: Path, key: dict[str, object]) -> dict[str, object] | None:
    """The cached record at ``path`` if it is whole and for ``key``; None otherwise (missing, corrupt, stale)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("key") != key or not _valid_costs(record.get("costs")):
        return None
    return record


def _write(path: Path, record: dict[str, object]) -> bool:
    """Write ``record`` atomically; False (and nothing written) where the cache cannot be written."""

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(path) as tmp:
            tmp.write_text(json.dumps(record, indent=1) + "\n")
    except OSError:
        return False
    return True


def benchmark_enabled() -> bool:
    """False when SPARROW_DTYPE_BENCHMARK is 0/false/no/off (the flags alone then decide, unless cached)."""
    return os.environ.get("SPARROW_DTYPE_BENCHMARK", "1").strip().lower() not in _OFF


_lock = threading.Lock()


def cpu_costs(*, benchmark: bool | None = None, refresh: bool = False, cache_dir: Path | str | None = None,
              info: CpuInfo | None = None) -> dict[str, object] | None:
    """This machine's measured costs (see ``measure``), with ``key``, ``path``, ``measured_at`` and ``cached``
    (True: read from the cache). Read from the cache when there; else measured now and cached, when
    ``benchmark`` (default: ``benchmark_enabled()``); else None. ``refresh`` measures again regardless."""
    info = info or cpu_info()
    benchmark = benchmark_enabled() if benchmark is None else benchmark
    key = cache_key(info)
    path = cache_path(key, cache_dir)
    with _lock:
        record = None if refresh else read_cached(path, key)
        if record is not None:
            return {**record, "path": str(path), "cached": True}
        if not benchmark and not refresh:
            return None
        record = {"key": key, "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  **measure()}
        written = _write(path, record)
    return {**record, "path": str(path) if written else None, "cached": False}


# --- the choice ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Choice:
    """What ``--dtype auto`` resolves to on a device, and why."""

    dtype: torch.dtype
    reason: str
    device: torch.device
    measured: dict[str, object] | None = field(default=None, compare=False)  # the CPU costs it was based on


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _versus(fast: dict[str, float], slow: dict[str, float]) -> str:
    """'1 row: a vs b ms; 8 rows: c vs d ms' for two kernels' costs."""
    return "; ".join(f"{n} row{'s' if n != '1' else ''}: {fast[n]:.2f} vs {slow[n]:.2f} ms"
                     for n in map(str, BENCH_ROWS))


def _choose_cpu(device: torch.device, benchmark: bool | None, cache_dir: Path | str | None) -> Choice:
    info = cpu_info()
    has = (f"{info.model} has {', '.join(info.bf16_flags)}" if info.bf16 else
           f"{info.model} has no bfloat16 instructions ({', '.join(BF16_FLAGS)}; torch converts to float32 inside)")
    record = cpu_costs(benchmark=benchmark, cache_dir=cache_dir, info=info)
    if record is None:
        return Choice(torch.bfloat16 if info.bf16 else torch.float32,
                      f"{has} (benchmark disabled): {'bfloat16' if info.bf16 else 'float32'}", device)
    costs = record["costs"]
    speedup = _faster_dense(costs)
    detail = _versus(costs["bfloat16"], _dense(costs, "float32"))
    if speedup >= MIN_BF16_SPEEDUP:
        return Choice(torch.bfloat16, f"{has}; bfloat16 measured {speedup:.2f}x faster than float32 ({detail}): "
                                      "bfloat16", device, record)
    return Choice(torch.float32, f"{has}; bfloat16 measured only {speedup:.2f}x float32's speed ({detail}; needs "
                                 f"{MIN_BF16_SPEEDUP}x): float32", device, record)


def _choose_cuda(device: torch.device) -> Choice:
    cuda = cuda_info(device)
    if cuda["bf16"]:
        return Choice(torch.bfloat16, f"{cuda['name']} (compute capability {cuda['capability']}) computes in "
                                      "bfloat16: bfloat16", device)
    return Choice(torch.float16, f"{cuda['name']} (compute capability {cuda['capability']}) has no native "
                                 "bfloat16: float16", device)


_choices: dict[tuple, Choice] = {}


def choose(device: str | torch.device | None = None, *, benchmark: bool | None = None,
           cache_dir: Path | str | None = None) -> Choice:
    """The dtype ``--dtype auto`` runs on ``device`` (None: CUDA if available, else the CPU), with its reason.
    Remembered per device in this process (``clear_cache`` forgets)."""

    dev = resolve_device(device)
    benchmark = benchmark_enabled() if benchmark is None else benchmark
    key = (str(dev), benchmark, str(cache_dir), os.environ.get("SPARROW_CACHE"), torch.get_num_threads())
    choice = _choices.get(key)
    if choice is None:
        if dev.type == "cpu":
            choice = _choose_cpu(dev, benchmark, cache_dir)
        elif dev.type == "cuda":
            choice = _choose_cuda(dev)
        else:
            choice = Choice(torch.float32, f"no detection for {dev.type} devices: float32", dev)
        _choices[key] = choice
    return choice


def choose_dtype(device: str | torch.device | None = None, *, benchmark: bool | None = None) -> tuple[torch.dtype, str]:
    """``(dtype, reason)``: what ``--dtype auto`` picks for ``device`` on this machine (see the module docstring)."""
    choice = choose(device, benchmark=benchmark)
    return choice.dtype, choice.reason


def choose_draft_quant(device: str | torch.device | None = None, *, benchmark: bool | None = None,
                       dtype: torch.dtype | None = None) -> tuple[str | None, str]:
    """``(format, reason)``: the weight format ``--draft-quant auto`` gives a draft model on ``device``: the
    quantized format (int8 / int4 weight-only, w8a8) whose one-row matmul this machine measured fastest, when it
    ran at least ``MIN_DRAFT_QUANT_SPEEDUP`` times faster than the dense dtype the benchmark compared it with; None
    (a dense draft) otherwise, where nothing was measured, and on CUDA (the kernels are measured on CPUs only).
    A draft runs one token a step, so its one-row cost is what counts; it never changes the output.

    dtype: the draft's compute dtype, when known. The weight-only kernels were measured with the benchmark's
    activation dtype only, and their speed depends on it, so a draft in another dtype chooses among w8a8 (int8
    activations, whatever the dtype) and dense."""

    dev = resolve_device(device)
    if dev.type != "cpu":
        return None, f"{dev.type}: drafts stay dense (the quantized kernels are measured on CPUs only)"
    record = cpu_costs(benchmark=benchmark)
    if record is None:
        return None, "no CPU measurement (benchmark disabled, nothing cached): drafts stay dense"
    costs, dense = record["costs"], str(record["quant_activations"])
    quants = [name for name in DRAFT_QUANTS if name in costs]
    if dtype is not None and _name(dtype) != dense:  # measured with other activations: only w8a8 carries over
        quants, dense = [name for name in quants if name == "w8a8"], _name(dtype)
    if not quants or dense not in costs:
        return None, "the measurement has no quantized kernels for this dtype: drafts stay dense"
    best = min(quants, key=lambda name: costs[name]["1"])
    base = _dense(costs, dense)["1"]
    speedup = base / costs[best]["1"]
    detail = f"{costs[best]['1']:.2f} vs {base:.2f} ms"
    if speedup < MIN_DRAFT_QUANT_SPEEDUP:
        return None, (f"the fastest quantized format ({best}) ran only {speedup:.2f}x {dense}'s speed at 1 row "
                      f"({detail}; needs {MIN_DRAFT_QUANT_SPEEDUP}x): drafts stay dense")
    return best, (f"{best} weights ran {speedup:.1f}x faster than {dense} at 1 row ({detail}): {best} drafts "
                  "(still lossless: the target verifies)")


def choose_onednn(device: str | torch.device | None = None, *, benchmark: bool | None = None) -> tuple[bool, str]:
    """``(route, reason)``: whether a float32 model on ``device`` runs its linear layers through oneDNN
    (``sparrow.runtime.onednn``): on a CPU where this machine measured that path at least ``MIN_ONEDNN_SPEEDUP`` times
    faster than torch's own float32 linear; never without a measurement, on other devices, or with
    ``SPARROW_ONEDNN=0``."""

    dev = resolve_device(device)
    if dev.type != "cpu":
        return False, f"{dev.type}: torch's own linear"
    if not _onednn_enabled():
        return False, "SPARROW_ONEDNN is off: torch's own linear"
    record = cpu_costs(benchmark=benchmark)
    if record is None:
        return False, "no CPU measurement (benchmark disabled, nothing cached): torch's own linear"
    costs = record["costs"]
    speedup = _onednn_speedup(costs)
    if not speedup:
        return False, "oneDNN's linear is not in this torch build: torch's own linear"
    detail = _versus(costs[ONEDNN], costs["float32"])
    if speedup >= MIN_ONEDNN_SPEEDUP:
        return True, f"oneDNN ran float32 {speedup:.2f}x faster than torch's linear ({detail}): oneDNN"
    return False, (f"oneDNN ran float32 only {speedup:.2f}x torch's linear's speed ({detail}; needs "
                   f"{MIN_ONEDNN_SPEEDUP}x): torch's own linear")


def clear_cache() -> None:
    """Forget the choices made in this process (the measurements on disk stay)."""
    _choices.clear()


__all__ = ["Choice", "choose", "choose_draft_quant", "choose_dtype", "choose_onednn", "clear_cache",
           "cpu_costs", "cuda_info", "measure"]
