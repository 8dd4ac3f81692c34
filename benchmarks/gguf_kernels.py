"""GGUF block kernels against torch's formats: one 8960 x 1536 linear (Qwen2.5-1.5B's MLP gate / up) at 1 and 8 rows.

Each round runs `sparrow doctor`'s own measurement of the existing formats (sparrow.runtime.microbench.measure:
float32, bfloat16, float32 through oneDNN, int8 / int4 weight-only, w8a8) and then the GGUF kernels (8-bit
activations for Q4_K and Q6_K (packed, as GGUFLinear runs them, and in the file's layout) / Q5_0 / Q8_0, float
activations for Q4_K) with the same harness: weights cycling through
copies worth 2x the L3, so they stream from memory; the fastest of the turns. Rounds alternate the two groups, so a
passing load on the (shared) machine hits both; the figures are the medians of the rounds, with min-max.

With `--isas avx2,avx512_vnni` each GGUF kernel is timed on each of those instruction sets in turn (rows
`Q4_K@avx2`, `Q4_K@avx512_vnni`, ...; the order flips every round), to compare them on one machine. `--rows` times
the GGUF kernels at other row counts (a verify's tokens; the packed kernels' tiles hold 6 rows, 12 on AVX-512),
`--kernels` picks some of them and `--gguf-only` leaves the torch formats out.

    python benchmarks/gguf_kernels.py --rounds 5 --out benchmarks/results/gguf_kernels.jsonl
    python benchmarks/gguf_kernels.py --rounds 5 --isas avx2,avx512_vnni
    python benchmarks/gguf_kernels.py --rounds 3 --gguf-only --kernels Q4_K-packed,Q6_K-packed --rows 1,4,6,7,9,12,16
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import time
from pathlib import Path

import torch

from sparrow.bench.runner import write_rows
from sparrow.runtime import gguf_kernels as gk
from sparrow.runtime.cpu import cpu_info
from sparrow.runtime.microbench import BENCH_ROWS, BENCH_SHAPE, _copies, _time_ms, cache_bytes, gguf_blocks, measure

# name, GGML type, 8-bit activations; "-packed": the layout GGUFLinear runs Q4_K / Q6_K weights in (gk.pack), the
# others the file's own layout (what GGUFLinear ran them in before 2026-12-02)
KERNELS = (("Q4_K-packed", gk.Q4_K, True), ("Q4_K", gk.Q4_K, True), ("Q6_K-packed", gk.Q6_K, True),
           ("Q6_K", gk.Q6_K, True), ("Q5_0", gk.Q5_0, True), ("Q8_0", gk.Q8_0, True), ("Q4_K-float", gk.Q4_K, False))


def measure_gguf(rows: tuple[int, ...] = BENCH_ROWS, shape: tuple[int, int] = BENCH_SHAPE,
                 names: tuple[str, ...] | None = None) -> dict[str, dict]:
    """ms per x @ W.T for each GGUF kernel (those `names`, default all), with microbench's harness (weights
    streamed from memory)."""
    out_features, in_features = shape
    working_set = min(max(2 * cache_bytes(), 64 << 20), 512 << 20)
    kernels = {}
    for name, qtype, int8 in KERNELS:
        if names is not None and name not in names:
            continue
        blocks = gguf_blocks(qtype, out_features, in_features)
        if name.endswith("-packed"):
            blocks, qtype = gk.pack(blocks, qtype, out_features, in_features), gk.PACKED[qtype]
        weights = _copies(lambda b=blocks: (b.clone(),), blocks.numel(), working_set)
        kernels[name] = functools.partial(
            lambda x, w, q, a: gk.matmul(x, next(w)[0], q, out_features, a), w=weights, q=qtype, a=int8)
    costs: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for n in rows:
            x = torch.randn(n, in_features)
            for name, ms in _time_ms({k: functools.partial(f, x) for k, f in kernels.items()}).items():
                costs.setdefault(name, {})[str(n)] = ms
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="JSONL file to append one row per kernel to")
    parser.add_argument("--isas", default="", help="comma-separated GGUF kernel instruction sets to compare "
                        f"({', '.join(gk.ISAS)}); default: the widest this CPU has, alone")
    parser.add_argument("--rows", default=",".join(map(str, BENCH_ROWS)),
                        help="comma-separated activation rows to time the GGUF kernels at (the torch formats: 1 and 8)")
    parser.add_argument("--kernels", default="", help="comma-separated GGUF kernels to time "
                        f"({', '.join(k[0] for k in KERNELS)}); default: all")
    parser.add_argument("--gguf-only", action="store_true", help="leave out the torch formats")
    args = parser.parse_args()
    assert gk.available(), gk.why_unavailable()
    isas = [name for name in args.isas.split(",") if name]
    try:
        sizes = tuple(int(n) for n in args.rows.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        parser.error(f"--rows takes positive integers separated by commas, got {args.rows!r}")
    names = tuple(k for k in args.kernels.split(",") if k) or None
    unknown = sorted(set(names or ()) - {k[0] for k in KERNELS})
    if unknown:
        parser.error(f"unknown --kernels {', '.join(unknown)}; expected some of {', '.join(k[0] for k in KERNELS)}")
    rounds: list[dict[str, dict[str, float]]] = []
    bandwidth = []
    for i in range(args.rounds):
        existing = {"costs": {}} if args.gguf_only else measure()
        if "bandwidth_gbs" in existing:
            bandwidth.append(existing["bandwidth_gbs"])
        gguf = {}
        for name in isas[::-1] if i % 2 else isas:
            gk.set_isa(name)
            gguf.update({f"{kernel}@{name}": ms for kernel, ms in measure_gguf(sizes, names=names).items()})
        gk.set_isa("auto")
        rounds.append({**existing["costs"], **(gguf or measure_gguf(sizes, names=names))})
        print(f"round {i + 1}: " + ", ".join(f"{k} " + "/".join(f"{ms:.2f}" for ms in v.values())
                                             for k, v in rounds[-1].items()), flush=True)
    info = cpu_info()
    meta = {"bench": "gguf_kernels", "shape": list(BENCH_SHAPE), "cpu": info.model, "flags": list(info.flags),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "isa": gk.isa(),
            "rounds": args.rounds, "bandwidth_gbs_median": statistics.median(bandwidth) if bandwidth else None,
            "date": time.strftime("%Y-%m-%d"), "machine": platform.machine()}
    columns = [str(n) for n in sorted({*sizes, *((BENCH_ROWS) if not args.gguf_only else ())})]
    rows = []
    print(f"\n{info.model} ({' '.join(info.flags)}), {meta['threads']} threads, kernels: {meta['isa']}")
    print("| kernel | " + " | ".join(f"{n} row{'s' if n != '1' else ''} ms (min-max)" for n in columns) + " |\n|---|"
          + "---:|" * len(columns))
    for name in rounds[0]:
        row = {"kernel": name, **meta, **({"isa": name.split("@")[1]} if "@" in name else {})}
        cells = []
        for n in columns:
            if n not in rounds[0][name]:  # a torch format at a row count it is not measured at
                cells.append("-")
                continue
            values = [r[name][n] for r in rounds]
            row[f"ms_{n}"] = round(statistics.median(values), 3)
            row[f"ms_{n}_min"], row[f"ms_{n}_max"] = round(min(values), 3), round(max(values), 3)
            cells.append(f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})")
        rows.append(row)
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.out is not None:
        write_rows(args.out, rows)


if __name__ == "__main__":
    main()
