"""DTW alignment of token-string sequences, on hand-made sequences (TokenTiming's mapping step)."""

from __future__ import annotations

import pytest

from sparrow.drafters.dtw import carry_confidence, dtw_path, edit_distance, target_to_source, token_cost


def mapping(source: list[str], target: list[str], **kwargs) -> list[list[int]]:
    return target_to_source(dtw_path(source, target, **kwargs), len(target))


def is_warping_path(path: list[tuple[int, int]], n: int, m: int) -> bool:
    steps = {(b[0] - a[0], b[1] - a[1]) for a, b in zip(path, path[1:])}
    return path[0] == (0, 0) and path[-1] == (n - 1, m - 1) and steps <= {(1, 1), (1, 0), (0, 1)}


@pytest.mark.parametrize("a, b, expected", [("", "", 0), ("abc", "", 3), ("kitten", "sitting", 3),
                                            ("flaw", "lawn", 2), ("same", "same", 0)])
def test_edit_distance(a, b, expected):
    assert edit_distance(a, b) == edit_distance(b, a) == expected


def test_cost_handles_each_tokenizers_space_marker():
    assert token_cost("Ġhello", "▁hello", "Ġ", "▁") == 0  # GPT-2 byte-level vs SentencePiece
    assert token_cost(" hello", "hello") == 0  # decoded pieces: a leading space is no difference
    assert token_cost("Ġ", "▁", "Ġ", "▁") == 0  # whitespace-only tokens still match each other
    assert token_cost("Ġ", "▁a", "Ġ", "▁") == 1
    assert token_cost("Ġhello", "hallo", "Ġ", "▁") == 1


def test_identical_sequences_align_on_the_diagonal():
    tokens = ["def", " add", "(a", ",", " b", "):"]
    assert dtw_path(tokens, tokens) == [(i, i) for i in range(len(tokens))]


def test_merge_maps_one_target_token_to_several_draft_tokens():
    # draft (GPT-2 markers) cut "hello" in two; the target (SentencePiece markers) has one token
    draft, target = ["Ġhel", "lo", "Ġworld"], ["▁hello", "▁world"]
    assert mapping(draft, target, marker_source="Ġ", marker_target="▁") == [[0, 1], [2]]


def test_split_maps_several_target_tokens_to_one_draft_token():
    draft, target = ["Ġhello", "Ġworld", "!"], ["▁hel", "lo", "▁world", "!"]
    assert mapping(draft, target, marker_source="Ġ", marker_target="▁") == [[0], [0], [1], [2]]


def test_insertion_of_a_space_token():
    # the target emits the space as its own token before a number
    draft, target = [" x", " =", " 42"], [" x", " =", " ", "42"]
    result = mapping(draft, target)
    assert result[0] == [0] and result[1] == [1] and result[3] == [2]
    assert result[2] and set(result[2]) <= {1, 2}


def test_newline_and_indentation_tokens():
    draft, target = [":\n", "   ", " return", " x"], [":", "\n   ", " return", " x"]
    result = mapping(draft, target)
    assert result[2] == [2] and result[3] == [3]
    assert is_warping_path(dtw_path(draft, target), 4, 4)


def test_band_widens_to_the_length_gap():
    draft = ["a"] * 3
    target = ["a"] * 50  # gap 47 > window 2: without widening no path would reach the end
    path = dtw_path(draft, target, window=2)
    assert is_warping_path(path, 3, 50)
    assert all(sources for sources in target_to_source(path, 50))


def test_band_limits_how_far_the_path_strays():
    draft = ["x", "y", "z", "w", "v", "u"]
    target = ["u", "v", "w", "z", "y", "x"]  # reversed: the cheapest unconstrained path would wander
    path = dtw_path(draft, target, window=1)
    assert is_warping_path(path, 6, 6) and all(abs(i - j) <= 1 for i, j in path)


def test_empty_sequences_have_no_path():
    assert dtw_path([], ["a"]) == [] and dtw_path(["a"], []) == []
    assert target_to_source([], 0) == []


def test_confidence_is_carried_as_the_lowest_aligned_draft_confidence():
    path = dtw_path(["Ġhel", "lo", "Ġworld"], ["▁hello", "▁world"], marker_source="Ġ", marker_target="▁")
    carried = carry_confidence([0.9, 0.4, 0.7], target_to_source(path, 2))
    assert carried == [0.4, 0.7]
