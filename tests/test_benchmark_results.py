"""benchmarks/results stays small and every path the docs cite there exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
LIMIT = 1_000_000
"""Bytes: rows are kept gzip-compressed (`.jsonl.gz`), without run logs or rendered plots."""
CITED = re.compile(r"(?<!--out )(?<![\w/.-])benchmarks/results/[A-Za-z0-9_.*{},/+-]*")
"""A path the prose cites (a command's `--out` names a new run's)."""
PLACEHOLDER = re.compile(r"\b[A-Z][A-Z_]+\b")  # DIR, NAME: a path the reader fills in


def docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "benchmarks" / "README.md"]


def expand(pattern: str) -> list[str]:
    """Shell brace expansion: "a.{jsonl.gz,md}" -> ["a.jsonl.gz", "a.md"]."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m is None:
        return [pattern]
    return [path for alt in m.group(1).split(",") for path in expand(pattern[: m.start()] + alt + pattern[m.end() :])]


def exists(cited: str) -> bool:
    """A file or folder, or a glob with a match; a command's plain `.jsonl` (`render X.jsonl`) is kept as .jsonl.gz."""
    relative = "benchmarks/" + cited.removeprefix("benchmarks/")
    if "*" in cited:
        return any(ROOT.glob(relative))
    return (ROOT / relative).exists() or (ROOT / f"{relative}.gz").exists()


def cited_paths(text: str, bare: bool = False) -> list[str]:
    """The results paths `text` cites outside code blocks; with `bare`, `results/...` too (benchmarks/README's)."""
    cited_re = re.compile(CITED.pattern.replace("benchmarks/results", "(?:benchmarks/)?results")) if bare else CITED
    paths, fenced = [], False
    for line in text.splitlines():
        fenced ^= line.lstrip().startswith("```")
        if fenced or line.startswith("    "):
            continue
        for cited in cited_re.findall(line):
            paths += [p.rstrip(".,/") for p in expand(cited) if not PLACEHOLDER.search(p)]
    return paths


def test_results_stay_under_a_megabyte():
    size = sum(p.stat().st_size for p in RESULTS.rglob("*") if p.is_file())
    assert size < LIMIT, f"benchmarks/results holds {size:,} bytes (limit {LIMIT:,}): gzip -9n the new rows"


def test_results_hold_rows_not_logs():
    plain = sorted(str(p.relative_to(ROOT)) for p in RESULTS.rglob("*") if p.suffix in (".jsonl", ".log", ".png"))
    assert not plain, f"compress rows (gzip -9n), drop run logs and plots rendered from rows: {plain}"


def test_cited_results_exist():
    missing = [(doc.relative_to(ROOT).as_posix(), cited) for doc in docs()
               for cited in cited_paths(doc.read_text(), bare=doc.parent.name == "benchmarks") if not exists(cited)]
    assert not missing, f"the docs cite results that are not there: {missing}"


def test_expand_and_exists_can_fail():
    assert expand("a/{b,c}.{jsonl.gz,md}") == ["a/b.jsonl.gz", "a/b.md", "a/c.jsonl.gz", "a/c.md"]
    assert not exists("benchmarks/results/no-such-study.jsonl.gz")
    assert cited_paths("rows `benchmarks/results/x/{a,b}.md`, see DIR, --out benchmarks/results/y, results/z.md") \
        == ["benchmarks/results/x/a.md", "benchmarks/results/x/b.md"]
    code = "```\nbenchmarks/results/a\n```\n    benchmarks/results/b\nresults/c"
    assert cited_paths(code, bare=True) == ["results/c"]
