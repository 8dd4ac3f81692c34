"""Which grammar engine sparrow uses: CPU cost per token of the next-token mask, and what each one enforces.

    nice -n 10 python benchmarks/grammar_engines.py            # smollm2-135m and qwen2.5-coder-0.5b tokenizers

For each tokenizer and engine: the time to compile a JSON schema, then per generated token of a fixed valid
answer (tokenized by the model's tokenizer) the time to compute the [vocab] mask and advance the state. Then
the correctness checks: for each schema feature (nested objects, enums, arrays, numbers with bounds, a regex)
whether the engine refuses a sample that breaks it while it takes one that keeps it.
"""

from __future__ import annotations

import json
import platform
import sys
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
ANSWER = {"name": "Ada Lovelace", "age": 36, "role": "admin", "tags": ["math", "poetry"],
          "address": {"city": "London", "zip": "W1"}}
# (feature, schema or ("regex", pattern), a text that keeps it, a text that breaks it)
CHECKS = [
    ("nested object", {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "integer"}}, "required": ["b"], "additionalProperties": False}}, "required": ["a"],
        "additionalProperties": False}, '{"a":{"b":1}}', '{"a":{"c":1}}'),
    ("enum", {"enum": ["red", "green"]}, '"red"', '"blue"'),
    ("array maxItems", {"type": "array", "items": {"type": "integer"}, "maxItems": 2}, "[1,2]", "[1,2,3]"),
    ("integer maximum", {"type": "integer", "minimum": 0, "maximum": 150}, "150", "151"),
    ("integer minimum", {"type": "integer", "minimum": 10}, "10", "9"),
    ("number bounds", {"type": "number", "minimum": 0, "maximum": 1}, "0.5", "1.5"),
    ("regex", ("regex", r"[0-9]{3}-[a-z]{2}"), "123-ab", "12-abc"),
    ("string maxLength: no raw control character", {"type": "string", "maxLength": 8}, '"ab"', '"a\x17"'),
    ("string minLength: no raw tab", {"type": "string", "minLength": 1}, '"ab"', '"a\tb"'),
]


def tokenizer_of(preset: str):
    from transformers import AutoTokenizer

    from sparrow.models.presets import gguf_path

    path = gguf_path(preset)
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok, vocab: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll, self.lt = llguidance, llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
        self.vocab = vocab

    def matcher(self, spec):
        g = (self.ll.LLMatcher.grammar_from_regex(spec[1]) if isinstance(spec, tuple)
             else self.ll.LLMatcher.grammar_from_json_schema(spec))
        m = self.ll.LLMatcher(self.tok, g)
        if m.is_error():
            raise ValueError(m.get_error())
        self.mask = self.lt.allocate_token_bitmask(1, self.vocab)
        return m

    def step(self, m, token: int) -> None:
        self.lt.fill_next_token_bitmask(m, self.mask, 0)
        assert m.consume_token(token), token

    def accepts(self, m, ids: list[int]) -> bool:
        return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok, vocab: int) -> None:
        import xgrammar

        self.x = xgrammar
        self.compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=vocab),
                                                 cache_enabled=False)
        self.vocab = vocab

    def matcher(self, spec):
        g = (self.compiler.compile_regex(spec[1]) if isinstance(spec, tuple)
             else self.compiler.compile_json_schema(json.dumps(spec)))
        self.mask = self.x.allocate_token_bitmask(1, self.vocab)
        return self.x.GrammarMatcher(g)

    def step(self, m, token: int) -> None:
        m.fill_next_token_bitmask(self.mask)
        assert m.accept_token(token), token

    def accepts(self, m, ids: list[int]) -> bool:
        return all(m.accept_token(t) for t in ids) and m.is_completed()


def byte_alphabet() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (byte-level BPE vocabularies are written in it)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    return {b: chr(b) if b in keep else chr(256 + i) for i, b in enumerate(sorted(set(range(256)) - set(keep)))}


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tok, vocab: int) -> None:
        import outlines_core

        self.o = outlines_core
        # The byte-level tokens as bytes (GPT-2 byte alphabet undone), as outlines-core's Vocabulary takes them.
        back = {c: b for b, c in byte_alphabet().items()}
        tokens: dict[bytes, list[int]] = {}
        eos = tok.eos_token_id
        for text, i in tok.get_vocab().items():
            if i == eos or i >= vocab:
                continue
            raw = bytes(back[c] for c in text) if all(c in back for c in text) else text.encode()
            tokens.setdefault(raw, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos, tokens)
        self.vocab = vocab

    def matcher(self, spec):
        from outlines_core.json_schema import build_regex_from_schema

        regex = spec[1] if isinstance(spec, tuple) else build_regex_from_schema(json.dumps(spec))
        guide = self.o.Guide(self.o.Index(regex, self.vocabulary))
        self.mask = torch.zeros((self.vocab + 31) // 32, dtype=torch.int32)
        return guide

    def step(self, m, token: int) -> None:
        m.write_mask_into(self.mask.data_ptr(), self.mask.numel(), 4)
        m.advance(token)

    def accepts(self, m, ids: list[int]) -> bool:
        return m.accepts_tokens(ids) and self._finished_after(m, ids)

    @staticmethod
    def _finished_after(m, ids):
        for t in ids:
            m.advance(t)
        return m.is_finished()


def measure(engine, tok) -> dict:
    ids = tok(json.dumps(ANSWER, separators=(",", ":")), add_special_tokens=False)["input_ids"]
    t0 = time.perf_counter()
    m = engine.matcher(SCHEMA)
    compile_s = time.perf_counter() - t0
    per_token = []
    for _ in range(5):
        m = engine.matcher(SCHEMA)
        t0 = time.perf_counter()
        for t in ids:
            engine.step(m, t)
        per_token.append((time.perf_counter() - t0) / len(ids))
    checks = {}
    for feature, spec, good, bad in CHECKS:
        try:
            ok = engine.accepts(engine.matcher(spec), tok(good, add_special_tokens=False)["input_ids"])
            refuses = not engine.accepts(engine.matcher(spec), tok(bad, add_special_tokens=False)["input_ids"])
            checks[feature] = ok and refuses
        except Exception as e:  # noqa: BLE001 - a benchmark: record what the engine could not do
            checks[feature] = f"error: {str(e).splitlines()[0][:80]}"
    return {"compile_ms": 1e3 * compile_s, "tokens": len(ids), "first_walk_us_per_token": round(1e6 * per_token[0], 1),
            "mean_us_per_token": round(1e6 * sum(per_token) / 5, 1),
            "all_5_walks_us": [round(1e6 * x, 1) for x in per_token], "checks": checks}


def main() -> None:
    torch.set_num_threads(1)
    print(f"# {platform.processor() or platform.machine()} python {sys.version.split()[0]} "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    for preset, vocab in (("smollm2-135m", 49152), ("qwen2.5-coder-0.5b", 151936)):
        tok = tokenizer_of(preset)
        for cls in (LLGuidance, XGrammar, OutlinesCore):
            t0 = time.perf_counter()
            try:
                engine = cls(tok, vocab)
                setup = time.perf_counter() - t0
                row = measure(engine, tok)
            except Exception as e:  # noqa: BLE001
                print(json.dumps({"tokenizer": preset, "engine": cls.name, "error": str(e)[:200]}))
                continue
            print(json.dumps({"tokenizer": preset, "vocab": vocab, "engine": cls.name,
                              "tokenizer_setup_s": round(setup, 2), **row}), flush=True)


if __name__ == "__main__":
    main()
