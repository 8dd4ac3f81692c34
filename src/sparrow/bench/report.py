"""The report of a bench directory, rendered from its JSONL rows alone: markdown tables per task and
overall, and PNG plots (speedup per task per method, acceptance per draft position)."""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Sequence
from pathlib import Path

from sparrow.bench.metrics import OVERALL, Cell, split_setups, summarize
from sparrow.errors import UserError


def read_jsonl(path: str | Path) -> list[str]:
    """The lines of a JSONL file kept as `path` or compressed as `path`.gz (benchmarks/results keeps rows gzipped),
    the compressed ones first (rows a later run appended to a plain file follow them)."""
    path = Path(str(path).removesuffix(".gz"))
    packed = Path(f"{path}.gz")
    text = (gzip.decompress(packed.read_bytes()).decode() if packed.exists() else "") + (
        path.read_text() if path.exists() else "")
    return text.splitlines()


def read_rows(directory: str | Path) -> list[dict]:
    """All rows of every *.jsonl (or *.jsonl.gz) file in `directory` (several runs combine into one report)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise UserError(f"report directory {str(directory)!r} does not exist")
    rows = []
    for path in sorted({p.with_suffix("") if p.suffix == ".gz" else p for p in directory.glob("*.jsonl*")}):
        lines = read_jsonl(path)
        for number, line in enumerate(lines, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:  # a run killed mid-write leaves a partial last line
                    if number != len(lines):
                        raise UserError(f"{path}: line {number} is not JSON") from None
    if not rows:
        raise UserError(f"no JSONL rows in {str(directory)!r} (expected the rows-*.jsonl of sparrow bench)")
    return rows


def _speedup(c: Cell) -> str:
    if c.speedup is None:
        return "1.00x (baseline)" if c.method == c.baseline else "n/a"
    return f"{c.speedup:.2f}x ± {c.speedup_std:.2f}" if c.repeats > 1 else f"{c.speedup:.2f}x"


def _f(value: float | None, fmt: str = "{:.2f}") -> str:
    return "n/a" if value is None else fmt.format(value)


def _matrix(cells: Sequence[Cell], title: str, show) -> list[str]:
    tasks = list(dict.fromkeys(c.task for c in cells))
    methods = list(dict.fromkeys(c.method for c in cells))
    by = {(c.task, c.method): c for c in cells}
    lines = [f"### {title}", "", "| method | " + " | ".join(tasks) + " |", "|---|" + "---:|" * len(tasks)]
    for m in methods:
        lines.append(f"| {m} | " + " | ".join(show(by[(t, m)]) if (t, m) in by else "" for t in tasks) + " |")
    return [*lines, ""]


def _skipped(rows: Sequence[dict]) -> list[str]:
    """The methods a run skipped (and no run of this setup measured), with the reason."""
    measured = {r["method"] for r in rows if "skipped" not in r}
    notes = {r["method"]: r["skipped"] for r in rows if "skipped" in r and r["method"] not in measured}
    if not notes:
        return []
    lines = ["### Skipped methods", "", "| method | why |", "|---|---|"]
    return [*lines, *(f"| {method} | {why} |" for method, why in notes.items()), ""]


def render_markdown(rows: Sequence[dict]) -> str:
    """Markdown for rows of one setup."""
    cells = summarize(rows)
    setup = rows[0].get("setup", {})
    runs = sorted({r.get("run_id", "") for r in rows})
    first = rows[0]
    lines = [
        "## Spec-Bench: " + ", ".join(f"{k}={v}" for k, v in setup.items()),
        "",
        f"device {first.get('device')}, {first.get('threads')} threads, torch {first.get('torch')}, "
        f"transformers {first.get('transformers')}; runs {', '.join(runs)}.",
        "Greedy, batch 1. Speedup = mean per-question tok/s of the method / that of its baseline (sparrow "
        "methods: `plain`, sparrow's plain decoding; transformers peers: `hf-plain`, its plain `generate`), "
        "same questions and repeat; ± = std over repeats. τ = mean tokens per target decoding step, bonus "
        "included. exact = outputs identical to the baseline's (= plain: to sparrow's plain decoding); "
        "in bfloat16 near-ties may flip a token, so read them as agreement rates.",
        "",
        "### Overall",
        "",
        "| method | baseline | questions | repeats | tok/s | speedup | τ (tok/step) | exact | = plain | wall s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        if c.task == OVERALL:
            exact = f"{c.exact}/{c.compared}" if c.compared else "-"
            plain = f"{c.same_as_plain}/{c.compared_to_plain}" if c.compared_to_plain else "-"
            lines.append(f"| {c.method} | {c.baseline} | {c.questions} | {c.repeats} | {c.tokens_per_second:.2f} | "
                         f"{_speedup(c)} | {_f(c.mean_accepted_tokens)} | {exact} | {plain} | {c.seconds:.1f} |")
    lines.append("")
    lines += _skipped(rows)
    lines += _matrix(cells, "Speedup per task", _speedup)
    lines += _matrix(cells, "Mean accepted tokens per step (τ) per task", lambda c: _f(c.mean_accepted_tokens))
    lines += _matrix(cells, "Tokens per second per task", lambda c: f"{c.tokens_per_second:.2f}")
    lines += _matrix(cells, "Exact match with the baseline per task",
                     lambda c: f"{c.exact}/{c.compared}" if c.compared else "-")
    overall = [c for c in cells if c.task == OVERALL and c.acceptance_per_position]
    if overall:
        width = max(len(c.acceptance_per_position) for c in overall)
        lines += ["### Acceptance rate per draft position (overall)", "",
                  "| method | " + " | ".join(str(i + 1) for i in range(width)) + " |", "|---|" + "---:|" * width]
        for c in overall:
            rates = ["-" if math.isnan(r) else f"{r:.2f}" for r in c.acceptance_per_position] + [""] * (
                width - len(c.acceptance_per_position)
            )
            lines.append(f"| {c.method} | " + " | ".join(rates) + " |")
        lines.append("")
    lines += _choices(rows)
    return "\n".join(lines)


def _choices(rows: Sequence[dict]) -> list[str]:
    """Rounds per drafting option of methods that choose among several ("auto"), summed over all rows."""
    totals: dict[str, dict[str, int]] = {}
    for r in rows:
        for option, n in (r.get("drafter_choices") or {}).items():
            totals.setdefault(r["method"], {})
            totals[r["method"]][option] = totals[r["method"]].get(option, 0) + n
    if not totals:
        return []
    lines = ["### Rounds per drafting option", "", "| method | rounds per option |", "|---|---|"]
    for method, counts in totals.items():
        lines.append(f"| {method} | " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))
                     + " |")
    return [*lines, ""]


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("the bench plots need matplotlib: pip install 'sparrow[bench]'") from None
    return plt


def plot_speedup(cells: Sequence[Cell], path: Path) -> None:
    """Grouped bars: speedup per task (and overall) for each non-baseline method, std as error bars."""
    plt = _pyplot()
    cells = [c for c in cells if c.speedup is not None]
    tasks = list(dict.fromkeys(c.task for c in cells))
    methods = list(dict.fromkeys(c.method for c in cells))
    by = {(c.task, c.method): c for c in cells}
    fig, ax = plt.subplots(figsize=(min(11.0, 3.0 + 1.1 * len(tasks)), 4.0))
    width = 0.8 / max(1, len(methods))
    for j, m in enumerate(methods):
        xs = [i + (j - (len(methods) - 1) / 2) * width for i, t in enumerate(tasks) if (t, m) in by]
        ys = [by[(t, m)].speedup for t in tasks if (t, m) in by]
        errs = [by[(t, m)].speedup_std or 0.0 for t in tasks if (t, m) in by]
        ax.bar(xs, ys, width, yerr=errs if any(errs) else None, label=m, capsize=2)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(tasks)), tasks, rotation=20)
    ax.set_ylabel("speedup over own plain decoding")
    ax.set_title("Spec-Bench speedup per task")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_acceptance(cells: Sequence[Cell], path: Path) -> None:
    """Acceptance rate per draft position (overall), one line per method that drafts."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    for c in cells:
        if c.task == OVERALL and c.acceptance_per_position:
            positions = range(1, len(c.acceptance_per_position) + 1)
            ax.plot(positions, c.acceptance_per_position, marker="o", label=c.method)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate (accepted / drafted)")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance per draft position (overall)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(directory: str | Path, rows: Sequence[dict] | None = None) -> Path:
    """report.md (+ speedup*.png, acceptance*.png) in `directory`, from `rows` or its JSONL files."""
    directory = Path(directory)
    rows = read_rows(directory) if rows is None else list(rows)
    if not rows:
        raise UserError("no rows to report")
    sections = []
    setups = split_setups(rows)
    for i, group in enumerate(setups.values()):
        suffix = "" if len(setups) == 1 else f"-{i + 1}"
        cells = summarize(group)
        plot_speedup(cells, directory / f"speedup{suffix}.png")
        plot_acceptance(cells, directory / f"acceptance{suffix}.png")
        sections.append(render_markdown(group)
                        + f"\n![speedup](speedup{suffix}.png)\n![acceptance](acceptance{suffix}.png)\n")
    path = directory / "report.md"
    path.write_text("# sparrow bench\n\n" + "\n".join(sections))
    return path
