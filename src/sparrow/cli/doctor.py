"""`sparrow doctor`: what sparrow detected on this machine, the measured per-token costs, and what `--dtype auto`,
`--draft-quant auto` and `--quant auto` pick and why (the work: sparrow.runtime.hardware), with one line naming the
target format that runs faster here than `generate`'s default, where one does (`make run` shows it)."""

from __future__ import annotations

import json
import platform
import sys
from importlib import metadata
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from sparrow.cli._common import cli_errors


@cli_errors
def doctor(
    as_json: Annotated[bool, typer.Option("--json", help="Print exactly one JSON object on stdout.")] = False,
    benchmark: Annotated[bool, typer.Option("--benchmark/--no-benchmark", help="Measure the per-token costs (rounds "
                                            "until they agree, a few seconds; cached per machine once stable, then "
                                            "checked by a quick round) or only read a cached measurement.")] = True,
    refresh: Annotated[bool, typer.Option("--refresh", help="Measure again even if a measurement is cached.")] = False,
    device: Annotated[Optional[str], typer.Option(help="Default: cuda if available, else cpu.")] = None,
) -> None:
    """Show the device, CPU features, versions and measured costs, and what --dtype auto picks and why."""
    from sparrow.models import resolve_device
    from sparrow.runtime import cpu, hardware

    dev = resolve_device(device)
    info = cpu.cpu_info()
    measured = hardware.cpu_costs(benchmark=benchmark, refresh=refresh, info=info)
    hardware.clear_cache(measurements=False)  # choose from the measurement just read or taken
    choice = hardware.choose(dev, benchmark=benchmark)
    draft_quant = hardware.choose_draft_quant(dev, benchmark=benchmark)
    target_quant = hardware.choose_target_quant(dev, benchmark=benchmark, gguf=True)  # a preset: a GGUF source
    record = report(dev, info, measured, choice, draft_quant, hardware.choose_onednn(dev, benchmark=benchmark),
                    target_quant)
    if as_json:
        sys.stdout.write(json.dumps(record, allow_nan=False) + "\n")
        return
    console = Console()
    console.print(table(record))
    line = faster_line(record)
    if line is not None:
        console.print(line, soft_wrap=True, highlight=False)


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def report(dev: Any, info: Any, measured: dict[str, Any] | None, choice: Any,
           draft_quant: tuple[str | None, str], onednn: tuple[bool, str] = (False, ""),
           target_quant: tuple[str | None, str] = (None, "")) -> dict[str, Any]:
    """The JSON record of `sparrow doctor`. `target_quant`: what `--quant auto` picks for a preset target (a GGUF
    source, so the GGUF file's own blocks are a candidate)."""
    import torch

    from sparrow.runtime import gguf_kernels, hardware

    cuda = hardware.cuda_info(dev) if dev.type == "cuda" else None
    benchmark = None
    if measured is not None:
        benchmark = {key: measured.get(key) for key in ("costs", "quant_activations", "unit", "shape", "seconds",
                                                         "measured_at", "cached", "path", "stability",
                                                         "bandwidth_gbs", "check")}
        benchmark["rows"] = list(hardware.BENCH_ROWS)
        if measured.get("costs") is not None and hardware.GGUF not in measured["costs"]:
            why = gguf_kernels.why_unavailable()  # set where this process could not build them
            benchmark["gguf_missing"] = (f"the GGUF kernels are unavailable ({why})" if why else
                                         "not in this measurement (taken where the GGUF kernels were not built; "
                                         "`sparrow doctor --refresh` measures again)")
    return {
        "device": str(dev),
        "cpu": {"model": info.model, "arch": info.arch, "logical_cpus": info.logical_cpus,
                "physical_cores": info.physical_cores, "flags": list(info.flags), "bf16_instructions": info.bf16,
                "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()},
        "cuda": cuda,
        "versions": {"sparrow": _version("sparrow"), "python": platform.python_version(), "torch": torch.__version__,
                     "transformers": _version("transformers")},
        "threads": {"intra_op": torch.get_num_threads(), "inter_op": torch.get_num_interop_threads()},
        "benchmark": benchmark,
        "auto": {"dtype": str(choice.dtype).removeprefix("torch."), "reason": choice.reason,
                 "draft_quant": draft_quant[0], "draft_quant_reason": draft_quant[1],
                 "float32_onednn": onednn[0], "float32_onednn_reason": onednn[1],
                 "quant": target_quant[0], "quant_reason": target_quant[1]},
    }


def table(record: dict[str, Any]) -> Table:
    """The human-readable table of a `doctor` record."""
    from sparrow.runtime import hardware

    cpu, versions, threads = record["cpu"], record["versions"], record["threads"]
    out = Table(show_header=False, box=None)
    out.add_row("device", record["device"])
    if record["cuda"] is not None:
        cuda = record["cuda"]
        out.add_row("GPU", f"{cuda['name']}, compute capability {cuda['capability']}, "
                           f"bfloat16 {'yes' if cuda['bf16'] else 'no'}")
    cores = f", {cpu['physical_cores']} physical cores" if cpu["physical_cores"] else ""
    out.add_row("CPU", f"{cpu['model']} ({cpu['arch']}, {cpu['logical_cpus']} logical CPUs{cores})")
    out.add_row("CPU flags", " ".join(cpu["flags"]) or "-")
    out.add_row("bf16 instructions", "yes" if cpu["bf16_instructions"] else "no")
    out.add_row("torch CPU kernels", str(cpu["torch_cpu_capability"]))
    out.add_row("versions", f"sparrow {versions['sparrow']}, torch {versions['torch']}, "
                            f"transformers {versions['transformers']}, python {versions['python']}")
    out.add_row("threads", f"{threads['intra_op']} (inter-op {threads['inter_op']})")
    bench = record["benchmark"]
    if bench is None:
        out.add_row("CPU costs", "not measured (--no-benchmark and nothing cached)")
    else:
        out.add_row("measurement", stability_line(bench))
    if bench is not None and bench["costs"] is not None:
        rows = [str(n) for n in bench["rows"]]
        shape = "x".join(map(str, bench["shape"]))
        source = f"cached {bench['measured_at']}" if bench["cached"] else f"measured now in {bench['seconds']:.2f} s"
        out.add_row("CPU costs", f"ms per {shape} matmul at {' / '.join(rows)} rows ({source})")
        fastest = min(sum(row.values()) for row in bench["costs"].values())
        for name, row in bench["costs"].items():
            label = {"float32": name, "bfloat16": name, hardware.ONEDNN: "float32 (oneDNN)",
                     hardware.GGUF: "gguf (Q4_K blocks, int8 activations)"}.get(
                name, f"{name} weights ({bench['quant_activations']})")
            ratio = sum(row.values()) / fastest
            cost = " / ".join(f"{row[n]:.2f}" for n in rows)
            out.add_row(f"  {label}", f"{cost} ms  ({rows[-1]} rows = {row[rows[-1]] / row[rows[0]]:.1f}x "
                                      f"{rows[0]} row; {ratio:.2f}x the fastest)")
        if bench.get("gguf_missing"):
            out.add_row("  gguf", bench["gguf_missing"])
    out.add_row("--dtype auto", f"{record['auto']['dtype']}: {record['auto']['reason']}")
    out.add_row("--draft-quant auto", f"{record['auto']['draft_quant'] or 'dense'}: "
                f"{record['auto']['draft_quant_reason']}")
    out.add_row("float32 linears", record["auto"]["float32_onednn_reason"])
    out.add_row("--quant auto", f"{record['auto']['quant'] or 'dense'} for a preset target: "
                f"{record['auto']['quant_reason']}")
    return out


def faster_line(record: dict[str, Any]) -> str | None:
    """One line naming the target format that ran a decoding step and a verify faster here than the dense default,
    with the flag that asks for it (None where none does): `generate` keeps its dense default (docs/models.md says
    why)."""
    from sparrow.runtime import hardware

    fmt, bench = record["auto"].get("quant"), record["benchmark"]
    if fmt is None or bench is None or not bench.get("costs") or fmt not in bench["costs"]:
        return None
    costs = bench["costs"]
    dense = hardware.dense_costs(costs, record["auto"]["dtype"]) if record["auto"]["dtype"] in costs else None
    what = "Q4_K blocks" if fmt == hardware.GGUF else f"{fmt} weights"
    speedup = None if dense is None else hardware.target_cost(dense) / hardware.target_cost(costs[fmt])
    versus = "" if speedup is None else f" {speedup:.1f}x {record['auto']['dtype']}"
    lossless = "the GGUF-quantized target" if fmt == hardware.GGUF else f"the {fmt}-quantized target"
    return (f"faster here: --quant {fmt} ({what}{versus} over a decoding step and a verify; lossless relative to "
            f"{lossless}; --quant auto picks it)")


def stability_line(bench: dict[str, Any]) -> str:
    """How far the benchmark's figures can be trusted: rounds, their spread, rejections, cache and load check."""
    stability = bench.get("stability") or {}
    rejected = stability.get("rejected") or []
    if bench.get("costs") is None:
        return (f"every one of {stability.get('rounds')} rounds rejected as inconsistent ({rejected[-1]}); "
                "nothing cached, --dtype auto falls back to the CPU flags")
    spread, used, rounds = stability.get("spread"), stability.get("used"), stability.get("rounds")
    if stability.get("stable"):
        text = (f"stable: {used} of {rounds} rounds agree within {100 * spread:.1f}% (tolerance "
                f"{100 * stability.get('tolerance', 0):.0f}%)")
    else:
        tolerance = 100 * stability.get("tolerance", 0)
        text = (f"UNSTABLE (machine busy; the CPU flags decide, the figures only a draft or target format that "
                f"beats the noise): {used} consistent of {rounds} rounds, spread {100 * (spread or 0):.0f}% "
                f"(tolerance {tolerance:.0f}%)")
    if rejected:
        count = len(rejected)
        text += f"; {count} inconsistent round{'s' * (count != 1)} rejected ({rejected[-1]})"
    if bench.get("bandwidth_gbs"):
        text += f"; memory read bandwidth {bench['bandwidth_gbs']:.1f} GB/s"
    if bench.get("cached"):
        text += f"; cached {bench.get('measured_at')}"
    elif stability.get("stable"):
        text += "; cached now"
    else:
        text += "; not cached (measured again next run)"
    check = bench.get("check")
    if check and check.get("replaced"):
        text += f"; replaced the cached figures (a quick check ran {check['ratio']:.2f}x their time)"
    elif check and check.get("ratio") is not None:
        text += f"; checked at load: {check['ratio']:.2f}x the cached time (agrees)"
    return text
