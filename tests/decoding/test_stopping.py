"""EOS, stop strings and max_new_tokens are exact when they fall anywhere inside an accepted
draft block: the output equals plain decoding under the same rule and never overshoots."""

from __future__ import annotations

import pytest
from conftest import VOCAB
from hypothesis import given, settings
from hypothesis import strategies as st

from sparrow.config import StoppingConfig
from sparrow.drafters import build_drafter
from sparrow.pipeline import Pipeline
from sparrow.stopping import MAX_UNSETTLED, Stopper

PROMPT = "def add(a, b):"
K = 8
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: threads only cost time on a shared CPU


@pytest.fixture(scope="module")
def full_acceptance(loaded_target) -> Pipeline:
    """Draft == target, so each round accepts all K drafts and a stop rule lands inside a block."""
    return Pipeline(loaded_target, build_drafter("draft-model", loaded_target, loaded_target, K))


@pytest.fixture(scope="module")
def reference(loaded_target) -> list[int]:
    return Pipeline(loaded_target, None).generate_plain(PROMPT, max_new_tokens=3 * K).token_ids


def with_eos(pipe: Pipeline, eos: int) -> Pipeline:
    pipe.eos_token_ids = lambda: frozenset({eos})  # declare a token the model produces to be EOS
    return pipe


@pytest.mark.parametrize("position", range(3 * K))
def test_eos_at_every_block_position(full_acceptance, reference, loaded_target, position):
    eos = reference[position]
    first = reference.index(eos)  # the output must stop at the first occurrence
    spec = with_eos(Pipeline(loaded_target, full_acceptance.drafter), eos).generate(PROMPT, max_new_tokens=3 * K)
    plain = with_eos(Pipeline(loaded_target, None), eos).generate_plain(PROMPT, max_new_tokens=3 * K)
    assert spec.token_ids == plain.token_ids == reference[: first + 1]
    assert spec.finish_reason == plain.finish_reason == "stop"


@pytest.mark.parametrize("max_new_tokens", range(1, 2 * K + 3))
def test_max_new_tokens_exact_with_full_acceptance(full_acceptance, reference, max_new_tokens):
    result = full_acceptance.generate(PROMPT, max_new_tokens=max_new_tokens)
    assert result.token_ids == reference[:max_new_tokens]
    assert result.finish_reason == "length"
    assert result.stats.num_accepted_tokens == result.stats.num_draft_tokens  # drafting really ran


def test_stop_strings_at_every_block_position(full_acceptance, reference, loaded_target):
    tokenizer = loaded_target.tokenizer
    plain_pipe = Pipeline(loaded_target, None)
    checked = 0
    for end in range(1, 3 * K):
        piece = tokenizer.decode(reference[end - 1 : end])
        if not piece.strip() or "\ufffd" in piece:
            continue
        text_before = tokenizer.decode(reference[: end - 1])
        spec = full_acceptance.generate(PROMPT, max_new_tokens=3 * K, stop=[piece])
        plain = plain_pipe.generate_plain(PROMPT, max_new_tokens=3 * K, stop=[piece])
        assert spec.token_ids == plain.token_ids
        assert spec.text == plain.text
        assert piece not in spec.text and spec.finish_reason == "stop"
        assert len(spec.token_ids) <= end and spec.text == text_before[: len(spec.text)]
        checked += 1
    assert checked >= 5


def test_stop_string_spanning_tokens(tokenizer):
    ids = tokenizer("return a + b")["input_ids"]
    stopper = Stopper(StoppingConfig(max_new_tokens=50, stop_strings=("a + b",)), tokenizer)
    kept = stopper.push(ids + ids)
    assert stopper.finish_reason == "stop" and kept == ids and stopper.text() == "return "


def test_stopper_drops_tokens_after_the_cut():
    stopper = Stopper(StoppingConfig(max_new_tokens=3, eos_token_ids=frozenset({7})))
    assert stopper.push([1, 7, 2]) == [1, 7] and stopper.finish_reason == "stop"
    assert stopper.push([4]) == []
    stopper = Stopper(StoppingConfig(max_new_tokens=3))
    assert stopper.push([1, 2, 3, 4, 5]) == [1, 2, 3] and stopper.finish_reason == "length"


class CountingTokenizer:
    """Wraps a tokenizer; records how many tokens each decode call decodes."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decoded: list[int] = []

    def decode(self, ids, **options) -> str:
        self.decoded.append(len(ids))
        return self.tokenizer.decode(ids, **options)


def test_stop_strings_decode_a_bounded_tail_per_token(tokenizer):
    """A long output pushed token by token: the decoding work grows linearly, not quadratically."""
    ids = tokenizer("def add(a, b):\n    return a + b\n")["input_ids"] * 150
    counting = CountingTokenizer(tokenizer)
    stopper = Stopper(StoppingConfig(max_new_tokens=len(ids), stop_strings=("never there",)), counting)
    for token in ids:
        stopper.push([token])
    assert stopper.finish_reason == "length" and len(ids) > 2000
    assert max(counting.decoded) <= 4 and sum(counting.decoded) <= 4 * len(ids)


def assert_stops_where_full_decoding_would(tokenizer, ids: list[int], data, longest_stop: int) -> None:
    """Draw a stop string from the decoded `ids` (up to `longest_stop` characters); pushing `ids` one by one, the
    Stopper must stop at the first token whose full decode contains it (or not at all)."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    start = data.draw(st.integers(0, max(0, len(text) - 1)))
    stop = text[start : start + data.draw(st.integers(1, longest_stop))] or "x"
    expected = next((i for i in range(1, len(ids) + 1)
                     if stop in tokenizer.decode(ids[:i], skip_special_tokens=True)), None)
    stopper = Stopper(StoppingConfig(max_new_tokens=len(ids) + 1, stop_strings=(stop,)), tokenizer)
    for token in ids:
        stopper.push([token])
    assert (len(stopper.tokens) if stopper.finish_reason == "stop" else None) == expected


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40), st.data())
def test_stop_strings_stop_where_decoding_everything_would(tokenizer, ids, data):
    """Random tokens (incomplete UTF-8 characters and special tokens included): the stop fires at the first
    token whose full decode contains a stop string, as if the whole output were decoded at every token."""
    assert_stops_where_full_decoding_would(tokenizer, ids, data, longest_stop=4)


def byte_tokens(tokenizer) -> list[int]:
    """Tokens that decode to U+FFFD alone: bytes of multi-byte characters (or no character at all)."""
    return [i for i in range(VOCAB) if tokenizer.decode([i]) == "\ufffd"]


def hostile_output(tokenizer, kind: str, n: int = 1000) -> list[int]:
    """Outputs a broken or sampled model can produce, each of which once made the unsettled tail grow."""
    if kind == "lone continuation bytes":
        return [byte_tokens(tokenizer)[0]] * n
    if kind == "special tokens":
        return [tokenizer.eos_token_id] * n
    if kind == "real U+FFFD characters":
        return tokenizer("\ufffd" * n)["input_ids"][:n]
    if kind == "text between special tokens":
        return ((tokenizer("return a + b")["input_ids"] + [tokenizer.eos_token_id] * 20) * n)[:n]
    assert kind == "random bytes"
    pool = byte_tokens(tokenizer)
    return [pool[(i * 7919) % len(pool)] for i in range(n)]


@pytest.mark.parametrize("kind", ["lone continuation bytes", "special tokens", "real U+FFFD characters",
                                  "text between special tokens", "random bytes"])
def test_stop_string_work_per_token_is_bounded(tokenizer, monkeypatch, kind):
    """Whatever the output, each token decodes a bounded number of tokens and scans a bounded number of
    characters for stop strings (counted, not timed): O(n) work for n tokens, where decoding everything
    after every token is O(n^2)."""
    ids = hostile_output(tokenizer, kind)
    counting = CountingTokenizer(tokenizer)
    scanned: list[int] = []
    find = Stopper._find_stop
    monkeypatch.setattr(Stopper, "_find_stop", lambda self, text: scanned.append(len(text)) or find(self, text))
    stop = "never there"
    stopper = Stopper(StoppingConfig(max_new_tokens=len(ids), stop_strings=(stop,)), counting)
    per_token = []
    for token in ids:
        before = sum(counting.decoded)
        stopper.push([token])
        per_token.append(sum(counting.decoded) - before)
    assert stopper.finish_reason == "length"
    assert max(per_token) <= 5 * MAX_UNSETTLED, max(per_token)  # tokens decoded for one new token: a constant
    assert sum(per_token) <= 2 * MAX_UNSETTLED * len(ids), sum(per_token)  # decoding all: ~len(ids) ** 2 / 2
    longest_token_text = 16  # characters one token of the tiny vocabulary decodes to, with room
    assert max(scanned) <= len(stop) - 1 + (MAX_UNSETTLED + 1) * longest_token_text, max(scanned)


@pytest.mark.parametrize("text, stop", [("naïve 🦜 text", "🦜"), ("naïve 🦜 text", "ve 🦜 t"), ("café", "é"),
                                        ("a\ufffdb", "\ufffd"), ("x é y", " é ")])
def test_multi_byte_stop_strings_fire_on_the_token_that_completes_them(tokenizer, text, stop):
    """A stop string whose characters span several byte tokens fires on the token that completes it, no
    sooner (its first bytes decode to U+FFFD) and no later."""
    ids = tokenizer(text + " the end")["input_ids"]
    expected = next(i for i in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:i]))
    stopper = Stopper(StoppingConfig(max_new_tokens=100, stop_strings=(stop,)), tokenizer)
    assert stopper.push(ids) == ids[:expected] and stopper.finish_reason == "stop"
    assert stopper.text() == text[: text.index(stop)]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_stop_strings_exact_over_long_runs_of_broken_bytes(tokenizer, data):
    """Mostly byte tokens and special tokens, long enough that the unsettled tail hits its limit and is
    settled early: the stop still fires where decoding the whole output after every token would."""
    pool = byte_tokens(tokenizer) + [tokenizer.eos_token_id] * 20 + list(range(VOCAB - 40, VOCAB))
    ids = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=120))
    assert_stops_where_full_decoding_would(tokenizer, ids, data, longest_stop=5)
