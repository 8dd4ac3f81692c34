"""What this machine computes fast, and the dtype ``--dtype auto`` picks from it.

* CPU: the instruction-set flags of ``/proc/cpuinfo`` (``avx512_bf16``, ``amx_bf16``, ``avx512_vnni``, ...),
  and a short micro-benchmark: one decoder MLP projection (a 1536 x 8960 weight, Qwen2.5-1.5B's) applied to
  1 row (a plain decoding step) and to 8 rows (verifying a draft), in float32 (torch's linear and oneDNN's,
  ``sparrow.runtime.onednn``) and bfloat16, then with int8 and int4 weight-only weights and w8a8
  (``sparrow.runtime.quant``'s kernels) in the dtype picked, and the GGUF kernels on Q4_K blocks with 8-bit
  activations (``sparrow.runtime.gguf_kernels``, where they are built), each kernel cycling through copies of its weight
  worth twice the L3, so they stream from memory as a model's weights do. One round takes about 0.6 s (3 s on
  an AVX2-only CPU) on 2 cores. A busy machine (a model install, dequantization, another job) cannot poison it:
  rounds repeat until ``MIN_ROUNDS`` consistent rounds agree within ``STABLE_TOLERANCE`` (at most ``MAX_ROUNDS``)
  and the figures are their medians (rounds that never agree are neither cached nor chosen by: the flags
  decide); a round is rejected when it contradicts itself (more rows faster than fewer, or a kernel streaming
  its weights faster than ``MAX_BANDWIDTH_RATIO`` x the memory bandwidth measured beside it). Only a stable
  measurement is cached per machine in ``<cache>/hardware/`` (keyed by CPU model, flags, threads and torch
  version); a cached one is checked once per process by a quick dense-only round, and measured
  again (and replaced) when that round runs ``RECHECK_FASTER`` faster than the cache says: other work only ever
  adds time, so a quiet check faster than the cache means the cache was taken under load. ``sparrow doctor
  --refresh`` measures again regardless.
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

``choose_draft_quant(device, gguf=...)`` picks the weight format of a draft model (``--draft-quant auto``, the CLI's
default): the quantized format (for a draft with a GGUF source, its file's own blocks among them) that ran one row
fastest, when it beat the dense dtype by ``MIN_DRAFT_QUANT_SPEEDUP``
(int4 here at 4.4x on an AMD EPYC with avx512_bf16; int8 was ~2.5x faster on an AVX-512/VNNI CPU without bf16),
among the formats measured in the draft's own compute dtype (weight-only kernels with float32 activations ran
4-10x slower than with bfloat16 ones on an AVX2-only CPU).

``choose_target_quant(device, gguf=...)`` picks the target's (``--quant auto``): the format with the lowest
``target_cost``, the geometric mean of its 1-row and 8-row costs (a target runs both: plain decoding steps and
verifications, and each counts by its ratio, so neither the larger 8-row figure nor the 1-row one alone decides),
when it beats the dense dtype's by ``MIN_TARGET_QUANT_SPEEDUP``, among int8, int4, w8a8 and, for a target with a
GGUF source, the GGUF file's own blocks. (It went by the 8-row cost alone until 2026-12-02: on an AMD EPYC Zen 5 that
picked w8a8, 0.30 / 0.49 ms at 1 / 8 rows, over the GGUF blocks, 0.18 / 0.63, whose plain decoding was 1.7x faster.)

``choose_onednn(device)`` says whether a float32 model runs its linears through oneDNN (where that measured
faster than torch's linear); float32's cost above is that of the path it runs.

Nothing here assumes one machine: the same code picks bfloat16 on a CPU with ``avx512_bf16`` where bf16 is
2-3x faster, float32 on an AVX-512/VNNI CPU without it where bf16 was no faster than float32, and float32
through oneDNN on an AVX2-only AMD EPYC, where bf16 beat torch's float32 linear (MKL) but not oneDNN's.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sparrow.paths import atomic_file, default_cache_dir
from sparrow.runtime import gguf_kernels
from sparrow.runtime.cpu import BF16_FLAGS, CpuInfo, cpu_info
from sparrow.runtime.devices import resolve_device
from sparrow.runtime.microbench import (
    BENCH_ROWS,
    BENCH_SHAPE,
    GGUF,
    MIN_BF16_SPEEDUP,
    MIN_ONEDNN_SPEEDUP,
    OFF,
    ONEDNN,
    dense_costs,
    dtype_name,
    faster_dense,
    inconsistencies,
    measure,
    measure_stable,
    onednn_enabled,
    onednn_speedup,
    recheck,
)

# bump when the cached record's layout or the benchmark changes (older caches remeasure); 5: stable rounds; 6: the
# GGUF kernel's row (a record of this format without it was measured where the kernels were not built: gguf is then
# unmeasured, never chosen, until `sparrow doctor --refresh`)
FORMAT = 6
MIN_DRAFT_QUANT_SPEEDUP = 1.1  # --draft-quant auto quantizes a draft only when one row runs at least this much faster
MIN_TARGET_QUANT_SPEEDUP = 1.1  # --quant auto quantizes the target only when its target_cost is this much lower
# the weight formats --draft-quant auto chooses among (sparrow.models.quantization)
DRAFT_QUANTS = ("int8", "int4", "w8a8")


# --- detection ------------------------------------------------------------------------------------------


def cuda_info(device: torch.device) -> dict[str, object]:
    """Name, compute capability and bfloat16 support of a CUDA device."""
    major, minor = torch.cuda.get_device_capability(device)
    return {"name": torch.cuda.get_device_name(device), "capability": f"{major}.{minor}",
            "bf16": (major, minor) >= (8, 0) and torch.cuda.is_bf16_supported(including_emulation=False)}


# --- the micro-benchmark ---------------------------------------------------------------------------------


# --- stable measurements ---------------------------------------------------------------------------------


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
    """The cached record at ``path`` if it is whole, for ``key``, stable and consistent; None otherwise (missing,
    corrupt, stale, or figures that contradict themselves)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("key") != key or not _valid_costs(record.get("costs")):
        return None
    stability = record.get("stability")
    if not isinstance(stability, dict) or stability.get("stable") is not True or inconsistencies(record):
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
    return os.environ.get("SPARROW_DTYPE_BENCHMARK", "1").strip().lower() not in OFF


_lock = threading.Lock()
_unsaved: dict[Path, dict[str, object]] = {}  # this process's measurements that were not cached (unstable)
_checked: dict[Path, dict[str, object]] = {}  # this process's load-time check of each cached measurement


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _measured(path: Path, key: dict[str, object], check: dict[str, object] | None = None) -> dict[str, object]:
    """Measure until stable (``measure_stable``); cache it only when stable, else keep it for this process."""
    record = {"key": key, "measured_at": _now(), **measure_stable(measure)}
    if check is not None:
        record["check"] = check
    written = bool(record["stability"]["stable"]) and _write(path, record)  # type: ignore[index]
    if not written:
        _unsaved[path] = record
    elif check is not None:
        _checked[path] = {**check, "replaced": True}  # what later reads in this process report
    return {**record, "path": str(path) if written else None, "cached": False}


def cpu_costs(*, benchmark: bool | None = None, refresh: bool = False, cache_dir: Path | str | None = None,
              info: CpuInfo | None = None) -> dict[str, object] | None:
    """This machine's measured costs (see ``measure`` and ``measure_stable``), with ``key``, ``path``,
    ``measured_at``, ``stability``, ``cached`` (True: read from the cache) and, for a cached record checked at
    load, ``check`` (see ``recheck``). Read from the cache when there (and, when ``benchmark``, checked once per
    process by a quick round; re-measured when that disagrees); else measured now (cached only when stable),
    when ``benchmark`` (default: ``benchmark_enabled()``); else None. ``refresh`` measures again regardless.
    ``costs`` is None when every round was rejected as inconsistent; only a stable record is chosen by (see
    ``usable``)."""
    info = info or cpu_info()
    benchmark = benchmark_enabled() if benchmark is None else benchmark
    key = cache_key(info)
    path = cache_path(key, cache_dir)
    with _lock:
        record = None if refresh else read_cached(path, key)
        if record is not None:
            if benchmark and path not in _checked:
                check = _checked[path] = recheck(record, measure)
                if not check["agreed"]:  # the cache was measured under load: measure again
                    return _measured(path, key, check)
            if path not in _unsaved:
                return {**record, "path": str(path), "cached": True, "check": _checked.get(path)}
        if not refresh and path in _unsaved:
            return {**_unsaved[path], "path": None, "cached": False}
        if not benchmark and not refresh:
            return None
        return _measured(path, key)


def usable(record: dict[str, object] | None) -> bool:
    """Whether ``cpu_costs`` returned figures to choose by: stable ones. Figures whose rounds never agreed (or
    were all rejected) are shown by ``sparrow doctor`` but chosen by no one: the CPU flags decide instead."""
    stability = record.get("stability") if record is not None else None
    return record is not None and record.get("costs") is not None and (
        not isinstance(stability, dict) or stability.get("stable") is True)


def noisy_margin(record: dict[str, object] | None) -> float | None:
    """The factor by which a ratio of two of the record's figures may be off: 1 for a stable record (``usable``);
    for an unstable one (figures there, rounds never agreed within the tolerance) (1 + spread)^2, each figure off by
    up to its spread. A choice whose measured ratio clears its threshold times this factor holds however the noise
    fell (a 4x faster draft format on a host busy enough for a 39 % spread). None: nothing to choose by."""
    if usable(record):
        return 1.0
    stability = record.get("stability") if record is not None else None
    if record is None or record.get("costs") is None or not isinstance(stability, dict):
        return None
    spread = stability.get("spread")
    return (1 + spread) ** 2 if isinstance(spread, (int, float)) and spread >= 0 else None


def unusable_reason(record: dict[str, object] | None) -> str:
    """Why ``usable(record)`` is False, in a few words."""
    if record is None:
        return "benchmark disabled, nothing cached"
    if record.get("costs") is None:
        return "every benchmark round was inconsistent: the machine was busy"
    return "the benchmark's rounds disagreed: the machine was busy; not cached"


# --- the choice ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Choice:
    """What ``--dtype auto`` resolves to on a device, and why."""

    dtype: torch.dtype
    reason: str
    device: torch.device
    measured: dict[str, object] | None = field(default=None, compare=False)  # the CPU costs it was based on


ROWS_SAID = "a decoding step and a verify (geometric mean of 1 and 8 rows)"
"""How reasons name what `target_cost` measures."""


def target_cost(cost: dict[str, float]) -> float:
    """A target format's cost to rank by: the geometric mean of its costs at every BENCH_ROWS row count (1: a plain
    decoding step, 8: a verification), so that a format twice as fast at one and as slow at the other ties."""
    return math.prod(cost[str(n)] for n in BENCH_ROWS) ** (1 / len(BENCH_ROWS))


def _versus(fast: dict[str, float], slow: dict[str, float]) -> str:
    """'1 row: a vs b ms; 8 rows: c vs d ms' for two kernels' costs."""
    return "; ".join(f"{n} row{'s' if n != '1' else ''}: {fast[n]:.2f} vs {slow[n]:.2f} ms"
                     for n in map(str, BENCH_ROWS))


def _choose_cpu(device: torch.device, benchmark: bool | None, cache_dir: Path | str | None) -> Choice:
    info = cpu_info()
    has = (f"{info.model} has {', '.join(info.bf16_flags)}" if info.bf16 else
           f"{info.model} has no bfloat16 instructions ({', '.join(BF16_FLAGS)}; torch converts to float32 inside)")
    record = cpu_costs(benchmark=benchmark, cache_dir=cache_dir, info=info)
    if not usable(record):
        why = unusable_reason(record)
        return Choice(torch.bfloat16 if info.bf16 else torch.float32,
                      f"{has} ({why}): {'bfloat16' if info.bf16 else 'float32'}", device)
    costs = record["costs"]
    speedup = faster_dense(costs)
    detail = _versus(costs["bfloat16"], dense_costs(costs, "float32"))
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


def _needs(record: dict[str, object], threshold: float, margin: float) -> str:
    """What a quantized format's lead must clear, for a reason string: the plain threshold, or for an unstable
    measurement (``margin`` > 1, see ``noisy_margin``) that threshold times the margin, and why."""
    if margin > 1:
        return (f"; {unusable_reason(record)}, so it needs {threshold * margin:.2f}x: {threshold}x times "
                "(1 + spread)^2")
    return f"; needs {threshold}x"


def choose_draft_quant(device: str | torch.device | None = None, *, benchmark: bool | None = None,
                       dtype: torch.dtype | None = None, gguf: bool = False) -> tuple[str | None, str]:
    """``(format, reason)``: the weight format ``--draft-quant auto`` gives a draft model on ``device``: the
    quantized format (int8 / int4 weight-only, w8a8, and with ``gguf`` the draft's GGUF file's own blocks) whose
    one-row matmul this machine measured fastest, when it ran at least ``MIN_DRAFT_QUANT_SPEEDUP`` times faster than
    the dense dtype the benchmark compared it with; None (a dense draft) otherwise, where nothing was measured, and
    on CUDA (the kernels are measured on CPUs only). An unstable measurement (a busy host) still decides where its
    gap clears that threshold times ``noisy_margin`` (a dense draft there ran 1.67x against int4's 2.69x).
    A draft runs one token a step, so its one-row cost is what counts; it never changes the output.

    dtype: the draft's compute dtype, when known. The weight-only kernels were measured with the benchmark's
    activation dtype only, and their speed depends on it, so a draft in another dtype chooses among w8a8 and gguf
    (int8 activations, whatever the dtype) and dense. gguf: the draft has a GGUF source whose blocks run (the
    caller knows, `sparrow.models.gguf_source`); gguf is then a candidate where the measurement has its row and the
    kernels load now."""

    dev = resolve_device(device)
    if dev.type != "cpu":
        return None, f"{dev.type}: drafts stay dense (the quantized kernels are measured on CPUs only)"
    record = cpu_costs(benchmark=benchmark)
    margin = noisy_margin(record)  # unstable figures decide only where the gap is wide
    if margin is None:
        return None, f"no CPU measurement to go by ({unusable_reason(record)}): drafts stay dense"
    costs, dense = record["costs"], str(record["quant_activations"])
    candidates = (*DRAFT_QUANTS, GGUF) if gguf and gguf_kernels.available() else DRAFT_QUANTS
    quants = [name for name in candidates if name in costs]
    if dtype is not None and dtype_name(dtype) != dense:  # measured with other activations: only 8-bit ones carry over
        quants, dense = [name for name in quants if name in ("w8a8", GGUF)], dtype_name(dtype)
    if not quants or dense not in costs:
        return None, "the measurement has no quantized kernels for this dtype: drafts stay dense"
    best = min(quants, key=lambda name: costs[name]["1"])
    base = dense_costs(costs, dense)["1"]
    speedup = base / costs[best]["1"]
    detail = f"{costs[best]['1']:.2f} vs {base:.2f} ms"
    needs = _needs(record, MIN_DRAFT_QUANT_SPEEDUP, margin)
    if speedup < MIN_DRAFT_QUANT_SPEEDUP * margin:
        return None, (f"the fastest quantized format ({best}) ran only {speedup:.2f}x {dense}'s speed at 1 row "
                      f"({detail}{needs}): drafts stay dense")
    detail += needs if margin > 1 else ""  # chosen by unstable figures: say what the lead cleared
    if best == GGUF:
        return best, (f"the GGUF kernels (Q4_K blocks, 8-bit activations) ran {speedup:.1f}x faster than {dense} at "
                      f"1 row ({detail}): the draft on its GGUF file's own blocks (still lossless: the target "
                      "verifies)")
    return best, (f"{best} weights ran {speedup:.1f}x faster than {dense} at 1 row ({detail}): {best} drafts "
                  "(still lossless: the target verifies)")


def choose_target_quant(device: str | torch.device | None = None, *, benchmark: bool | None = None,
                        dtype: torch.dtype | None = None, exclude: tuple[str, ...] = (),
                        gguf: bool = False) -> tuple[str | None, str]:
    """``(format, reason)``: the weight format ``--quant auto`` gives the target on ``device``: the quantized format
    (int8 / int4 weight-only, w8a8, and with ``gguf`` the GGUF file's own blocks; not those in ``exclude``) whose
    cost over a decoding step and a verify this machine measured lowest (``target_cost``: 1 and 8 rows), when it
    ran at least ``MIN_TARGET_QUANT_SPEEDUP`` times faster than the dense dtype (times ``noisy_margin`` for an
    unstable measurement, as for a draft); None (dense) otherwise, without a measurement, and on CUDA. Unlike a
    draft's, the target's format changes the output: decoding is then lossless relative to the quantized target,
    not to the dense one. ``dtype``: the target's compute dtype (see
    ``choose_draft_quant``; w8a8 and gguf quantize their activations whatever it is).

    gguf: the target has a GGUF source whose blocks ``--quant gguf`` runs (a preset or a .gguf file; the caller
    knows, ``sparrow.models.gguf_source``); gguf is then a candidate where the measurement has its row (the GGUF
    kernels were built when it was taken) and the kernels load now."""
    dev = resolve_device(device)
    if dev.type != "cpu":
        return None, f"{dev.type}: the target stays dense (the quantized kernels are measured on CPUs only)"
    record = cpu_costs(benchmark=benchmark)
    margin = noisy_margin(record)  # unstable figures decide only where the gap is wide
    if margin is None:
        return None, f"no CPU measurement to go by ({unusable_reason(record)}): the target stays dense"
    costs, dense = record["costs"], str(record["quant_activations"])
    candidates = (*DRAFT_QUANTS, GGUF) if gguf else DRAFT_QUANTS
    quants = [name for name in candidates if name in costs and name not in exclude]
    if dtype is not None and dtype_name(dtype) != dense:  # only the formats that quantize their activations carry over
        quants, dense = [name for name in quants if name in ("w8a8", GGUF)], dtype_name(dtype)
    if GGUF in quants and not gguf_kernels.available():  # measured once, but not loadable now (SPARROW_GGUF_KERNELS)
        quants.remove(GGUF)
    if not quants or dense not in costs:
        return None, "the measurement has no quantized kernels for this dtype: the target stays dense"
    best = min(quants, key=lambda name: target_cost(costs[name]))
    base = dense_costs(costs, dense)
    speedup = target_cost(base) / target_cost(costs[best])
    detail = _versus(costs[best], base)
    label = "gguf (Q4_K blocks, 8-bit activations)" if best == GGUF else best
    needs = _needs(record, MIN_TARGET_QUANT_SPEEDUP, margin)
    if speedup < MIN_TARGET_QUANT_SPEEDUP * margin:
        return None, (f"the fastest quantized format ({label}) ran only {speedup:.2f}x {dense}'s speed over "
                      f"{ROWS_SAID} ({detail}{needs}): the target stays dense")
    detail += needs if margin > 1 else ""  # chosen by unstable figures: say what the lead cleared
    if best == GGUF:
        return best, (f"the GGUF kernels (Q4_K blocks, 8-bit activations) ran {speedup:.1f}x faster than {dense} over "
                      f"{ROWS_SAID} ({detail}): the target on its GGUF file's own blocks (lossless relative to the "
                      "GGUF-quantized target, as llama.cpp runs it, not to the dense one)")
    return best, (f"{best} weights ran {speedup:.1f}x faster than {dense} over {ROWS_SAID} ({detail}): a {best} "
                  f"target (lossless relative to the {best}-quantized target, not to the dense one)")


def choose_onednn(device: str | torch.device | None = None, *, benchmark: bool | None = None) -> tuple[bool, str]:
    """``(route, reason)``: whether a float32 model on ``device`` runs its linear layers through oneDNN
    (``sparrow.runtime.onednn``): on a CPU where this machine measured that path at least ``MIN_ONEDNN_SPEEDUP`` times
    faster than torch's own float32 linear; never without a measurement, on other devices, or with
    ``SPARROW_ONEDNN=0``."""

    dev = resolve_device(device)
    if dev.type != "cpu":
        return False, f"{dev.type}: torch's own linear"
    if not onednn_enabled():
        return False, "SPARROW_ONEDNN is off: torch's own linear"
    record = cpu_costs(benchmark=benchmark)
    if not usable(record):
        return False, f"no CPU measurement to go by ({unusable_reason(record)}): torch's own linear"
    costs = record["costs"]
    speedup = onednn_speedup(costs)
    if not speedup:
        return False, "oneDNN's linear is not in this torch build: torch's own linear"
    detail = _versus(costs[ONEDNN], costs["float32"])
    if speedup >= MIN_ONEDNN_SPEEDUP:
        return True, f"oneDNN ran float32 {speedup:.2f}x faster than torch's linear ({detail}): oneDNN"
    return False, (f"oneDNN ran float32 only {speedup:.2f}x torch's linear's speed ({detail}; needs "
                   f"{MIN_ONEDNN_SPEEDUP}x): torch's own linear")


def clear_cache(measurements: bool = True) -> None:
    """Forget the choices made in this process and, with ``measurements``, its uncached measurements and load
    checks (as a new process would; the measurements on disk stay)."""
    _choices.clear()
    if measurements:
        _unsaved.clear()
        _checked.clear()


__all__ = ["Choice", "choose", "choose_draft_quant", "choose_dtype", "choose_onednn", "choose_target_quant",
           "target_cost",
           "clear_cache", "cpu_costs", "cuda_info", "inconsistencies", "measure", "measure_stable", "recheck", "usable"]
