"""Dynamic time warping between two token-string sequences (TokenTiming, arXiv 2510.15545).

The draft model writes a text in its own tokens; re-encoded by the target tokenizer the same
text is cut into different tokens. DTW aligns the two string sequences so that each target
position knows which draft positions produced its text, and the draft's confidence can be
carried over.

Cost of a pair = edit distance between the two strings once each tokenizer's space marker is
removed (`Ġ` for GPT-2 / Qwen byte-level BPE, `▁` for SentencePiece; a real space once pieces
are decoded); when removing it leaves a string empty, the strings are compared with their
markers as real spaces, so a lone space token still matches a lone space token.

The path starts at (0, 0), ends at (n - 1, m - 1) and moves by (1, 1), (1, 0) or (0, 1),
inside a Sakoe-Chiba band |i - j| <= max(window, |n - m|): the band widens to the length gap,
so a path always exists. Backtracking prefers the diagonal, then the draft axis, then the
target axis (TokenTiming's order).
"""

from __future__ import annotations

from collections.abc import Sequence

INF = float("inf")


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insert, delete, substitute all cost 1)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def token_cost(a: str, b: str, marker_a: str = " ", marker_b: str = " ") -> int:
    """Edit distance between two token strings, each tokenizer's space marker handled."""
    plain_a = a.replace(marker_a, " ").strip()
    plain_b = b.replace(marker_b, " ").strip()
    if not plain_a or not plain_b:  # whitespace-only token: compare with the spaces kept
        plain_a, plain_b = a.replace(marker_a, " "), b.replace(marker_b, " ")
    return edit_distance(plain_a, plain_b)


def dtw_path(source: Sequence[str], target: Sequence[str], window: int = 32, marker_source: str = " ",
             marker_target: str = " ") -> list[tuple[int, int]]:
    """Warping path [(source index, target index), ...] from (0, 0) to (n - 1, m - 1); [] if either is empty."""
    n, m = len(source), len(target)
    if n == 0 or m == 0:
        return []
    band = max(window, abs(n - m))
    # total[i][j]: cheapest path cost ending at (i - 1, j - 1); row / column 0 are the border.
    total = [[INF] * (m + 1) for _ in range(n + 1)]
    total[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(max(1, i - band), min(m, i + band) + 1):
            cost = token_cost(source[i - 1], target[j - 1], marker_source, marker_target)
            total[i][j] = cost + min(total[i - 1][j - 1], total[i - 1][j], total[i][j - 1])
    path, i, j = [], n, m
    while i > 0 and j > 0:
        path.append((i - 1, j - 1))
        steps = ((total[i - 1][j - 1], i - 1, j - 1), (total[i - 1][j], i - 1, j), (total[i][j - 1], i, j - 1))
        _, i, j = min(steps, key=lambda s: s[0])  # min keeps the first of equals: diagonal, up, left
    return path[::-1]


def target_to_source(path: Sequence[tuple[int, int]], num_target: int) -> list[list[int]]:
    """For each target index, the source indices the path pairs it with (every target index has one)."""
    mapping: list[list[int]] = [[] for _ in range(num_target)]
    for i, j in path:
        mapping[j].append(i)
    return mapping


def carry_confidence(confidence: Sequence[float], mapping: Sequence[Sequence[int]]) -> list[float]:
    """Per target position, the lowest confidence among the source positions aligned with it."""
    return [min((confidence[i] for i in sources), default=0.0) for sources in mapping]
