"""Structured output (`sparrow.grammar`): JSON schemas and regexes under speculation.

a) Every output keeps to its schema / regex (checked by `jsonschema` and `re`, engines other than the one that
   enforces it), even from a random tiny model; EOS only where the grammar is complete, "length" otherwise.
b) Lossless relative to constrained plain decoding: speculative output == the baseline's masked plain decoding
   token for token (float32), for draft-model / prompt-lookup / layer-skip drafters, chains and trees, greedy and
   rejection verifiers, with drafter-proposed tokens accepted (beyond the forced ones); seeded sampling equals
   its seeded constrained plain run; batched sequences with different grammars each equal their own run.
c) Sampled drafts (q given): a forbidden draft token stays as a sure reject, so the recovered token comes from
   the residual; the first token's distribution equals the masked target's (negative control: truncating
   before the forbidden token instead shifts it).
d) Errors: malformed / impossible schemas and regexes are one-line UserErrors (API, CLI) and 400s (server,
   through the official openai client, which also gets response_format output streamed and not).
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
import torch
from conftest import perturbed, tiny_model, tiny_tokenizer
from live import serving
from typer.testing import CliRunner

from sparrow.cli import app as cli
from sparrow.config import SamplingConfig
from sparrow.decoding.batch import Batch
from sparrow.drafters import build_drafter
from sparrow.errors import UserError
from sparrow.grammar import Grammars, GrammarSpec, masked
from sparrow.models import LoadedModel
from sparrow.pipeline import Pipeline
from sparrow.policy.batch import BatchPolicy
from sparrow.serve import Scheduler, create_app
from sparrow.types import Draft
from sparrow.verifiers import RejectionVerifier

pytestmark = pytest.mark.usefixtures("one_thread")

SCHEMAS = {
    "nested": {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "role": {"enum": ["admin", "guest"]}, "id": {"type": "integer", "minimum": 1, "maximum": 99}},
        "required": ["role", "id"], "additionalProperties": False}}, "required": ["user"],
        "additionalProperties": False},
    "array": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1,
              "maxItems": 3},
    "enum+bounds": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                                     "score": {"type": "number", "minimum": 0, "maximum": 1}},
                    "required": ["color", "score"], "additionalProperties": False},
    "strings": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                 "tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                                          "maxItems": 2}},
                "required": ["name", "tags"], "additionalProperties": False},
}
REGEXES = [r"[0-9]{3}-[a-z]{2,4}", r"(yes|no|maybe)", r"[0-9]{4}-[0-9]{2}-[0-9]{2}"]  # not \\d: any Unicode digit
PROMPTS = ['Extract: {"user": {"role": "admin", "id": 7}} ->', "The quick brown fox", "def add(a, b):"]
CASES = [*({"json_schema": s} for s in SCHEMAS.values()), *({"regex": r} for r in REGEXES)]
IDS = [*SCHEMAS, *(f"regex{i}" for i in range(len(REGEXES)))]
N = 160  # max_new_tokens: enough for the random model to finish most outputs


class Recording(Pipeline):
    """Keeps each generation's grammar constraint (its forced-token count)."""

    def constraint(self, request):
        c = super().constraint(request)
        self.constraints = [*getattr(self, "constraints", []), c]
        return c


@pytest.fixture(scope="module")
def close_draft(target_model, tokenizer) -> LoadedModel:
    return LoadedModel(perturbed(target_model, 0.05, seed=1), tokenizer, "close")


@pytest.fixture(scope="module")
def plain_runs(loaded_target) -> dict:
    pipe = Pipeline(loaded_target, None)
    return {(i, p): pipe.generate_plain(p, max_new_tokens=N, **case)
            for i, case in enumerate(CASES) for p in PROMPTS}


def conforms(text: str, case: dict) -> bool:
    if "regex" in case:
        return re.fullmatch(case["regex"], text) is not None
    try:
        jsonschema.validate(json.loads(text), case["json_schema"])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def prefix_of_grammar(pipe: Pipeline, case: dict, tokens: list[int]) -> bool:
    """The tokens are a prefix the grammar allows (an output cut by max_new_tokens)."""
    c = Grammars(pipe.tokenizer, pipe.runner.vocab_size).start(GrammarSpec.of(**case), pipe.eos_token_ids())
    return all(bool(c.allowed()[t]) and c.matcher.consume_token(t) for t in tokens)


# --- a) conformity --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_every_output_conforms_greedy_and_sampled(loaded_target, close_draft, plain_runs, case):
    spec = Pipeline(loaded_target, build_drafter("draft-model", loaded_target, close_draft, 4, adaptive=False))
    index = CASES.index(case)
    finished = 0
    for prompt in PROMPTS:
        runs = [plain_runs[(index, prompt)], spec.generate(prompt, max_new_tokens=N, **case),
                spec.generate(prompt, max_new_tokens=N, temperature=1.0, seed=5, **case),
                spec.generate(prompt, max_new_tokens=N, temperature=0.7, top_k=20, **case)]  # unseeded: rejection
        for r in runs:
            if r.finish_reason == "stop":
                assert conforms(r.text, case), (r.text, case)
                finished += 1
            else:  # cut by max_new_tokens: said so, and still a prefix the grammar allows
                assert r.finish_reason == "length" and len(r.token_ids) == N
                assert prefix_of_grammar(spec, case, r.token_ids), r.text
    assert finished >= 6, f"only {finished} of 12 outputs completed: the test checks too little"


def test_eos_only_where_the_grammar_is_complete(loaded_target):
    """After a full match only EOS is allowed (the output ends "stop"); before it, EOS is masked out, and an output
    max_new_tokens cuts short says "length"."""
    pipe = Pipeline(loaded_target, None)
    eos = loaded_target.tokenizer.eos_token_id
    done = pipe.generate_plain(PROMPTS[0], max_new_tokens=8, regex=r"(yes|no)")
    assert done.finish_reason == "stop" and done.token_ids[-1] == eos and done.text in ("yes", "no")
    assert eos not in done.token_ids[:-1]
    short = pipe.generate_plain(PROMPTS[0], max_new_tokens=2, json_schema=SCHEMAS["nested"])
    assert short.finish_reason == "length" and eos not in short.token_ids


# --- b) lossless relative to constrained plain decoding ---------------------------------------------------------


DRAFTERS = {
    "draft-model": lambda t, d: build_drafter("draft-model", t, d, 4, adaptive=False),
    "draft-model-tree": lambda t, d: build_drafter("draft-model", t, d, 4, adaptive=False, tree_budget=8,
                                                   tree_topk=2, tree_depth=4),
    "prompt-lookup": lambda t, d: build_drafter("prompt-lookup", t, None, 4, adaptive=False),
    "prompt-lookup-trie": lambda t, d: build_drafter("prompt-lookup", t, None, 8, adaptive=False, tree_budget=12,
                                                     tree_topk=3, tree_depth=4),
    "layer-skip": lambda t, d: build_drafter("layer-skip", t, None, 3, adaptive=False, skip_set="mlp=1",
                                             backoff=False),
}


@pytest.mark.parametrize("verifier", ["greedy", "rejection"])
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_speculative_equals_constrained_plain(loaded_target, close_draft, plain_runs, name, verifier):
    pipe = Recording(loaded_target, DRAFTERS[name](loaded_target, close_draft), verifier)
    accepted = forced = trees = 0
    for i, case in enumerate(CASES):
        for prompt in PROMPTS:
            result = pipe.generate(prompt, max_new_tokens=N, **case)
            assert result.token_ids == plain_runs[(i, prompt)].token_ids, (name, case, prompt)
            assert result.finish_reason == plain_runs[(i, prompt)].finish_reason
            accepted += result.stats.num_accepted_tokens
            forced += pipe.constraints[-1].forced
            trees += result.stats.tree_steps
    assert accepted > forced, (accepted, forced)  # drafts accepted beyond the tokens the grammar forced
    assert (trees > 0) == name.endswith(("tree", "trie"))


@pytest.mark.parametrize("name", ["draft-model", "draft-model-tree", "prompt-lookup"])
def test_seeded_sampling_equals_seeded_constrained_plain(loaded_target, close_draft, name):
    pipe = Pipeline(loaded_target, DRAFTERS[name](loaded_target, close_draft))
    accepted = 0
    for seed in (1, 2):
        for case in (CASES[0], CASES[3], CASES[4]):
            options = dict(max_new_tokens=80, temperature=0.8, seed=seed, **case)
            result = pipe.generate(PROMPTS[0], **options)
            assert result.token_ids == pipe.generate_plain(PROMPTS[0], **options).token_ids
            accepted += result.stats.num_accepted_tokens
    assert accepted > 0


def test_batched_sequences_each_keep_their_own_grammar(loaded_target, close_draft):
    pipe = Pipeline(loaded_target, build_drafter("draft-model", loaded_target, close_draft, 4, adaptive=False))
    requests = [(PROMPTS[0], CASES[0]), (PROMPTS[1], CASES[4]), (PROMPTS[2], {}), (PROMPTS[1], CASES[1])]
    seqs = [pipe.sequence(p, max_new_tokens=60, **case) for p, case in requests]
    batch = Batch(loaded_target.model, BatchPolicy(adaptive=False))
    for seq in seqs:
        batch.add(seq)
    while batch.running:
        batch.step()
    for seq, (prompt, case) in zip(seqs, requests):
        assert pipe.result(seq).token_ids == pipe.generate_plain(prompt, max_new_tokens=60, **case).token_ids
    assert sum(seq.decoded().stats.num_accepted_tokens for seq in seqs) > 0


# --- c) sampled drafts: a forbidden token is a sure reject, not a cut -----------------------------------------


def test_sampled_draft_forbidden_token_keeps_the_masked_distribution(tokenizer):
    """Draft x ~ q with q(a) = q(x) = 0.5, x forbidden by the regex [ab]c; masked target p(a) = 0.2, p(b) = 0.8.
    Rejection sampling with the sure-reject rule emits a with probability 0.2; cutting the draft before x (then
    sampling from p) would give 0.5 * 0.2 + 0.2 = 0.3."""
    ids = {c: tokenizer.convert_tokens_to_ids(c) for c in "abcx"}
    vocab = len(tokenizer)
    grammars = Grammars(tokenizer, vocab)
    q = torch.zeros(vocab)
    q[ids["a"]] = q[ids["x"]] = 0.5
    row = torch.full((vocab,), -30.0)
    row[ids["x"]] = 5.0  # the unmasked target likes x best
    row[ids["a"]], row[ids["b"]] = torch.tensor(0.2).log(), torch.tensor(0.8).log()
    sampling = SamplingConfig(temperature=1.0)
    g = torch.Generator().manual_seed(0)

    def first_token(cut: bool) -> int:
        x = ids["a"] if torch.rand((), generator=g) < 0.5 else ids["x"]
        c = grammars.start(GrammarSpec.of(regex="[ab]c"), [tokenizer.eos_token_id])
        draft = Draft(tokens=torch.tensor([x]), probs=q[None].clone())
        if cut and x == ids["x"]:
            draft = Draft.empty("cpu")
        draft, allowed = c.restrict(draft, 4)
        logits = masked(row.expand(len(draft) + 1, vocab), allowed)
        return int(RejectionVerifier().verify(draft, logits, sampling, g).tokens[0])

    n = 3000
    share = sum(first_token(cut=False) == ids["a"] for _ in range(n)) / n
    wrong = sum(first_token(cut=True) == ids["a"] for _ in range(n)) / n
    assert abs(share - 0.2) < 0.03, share  # 4 standard deviations
    assert abs(wrong - 0.3) < 0.035, wrong  # the negative control: the cut is detectably lossy


def test_forced_tokens_extend_a_chain_and_the_tree_walk_keeps_the_state(tokenizer):
    c = Grammars(tokenizer, len(tokenizer)).start(GrammarSpec.of(regex="abc(d|e)"), [tokenizer.eos_token_id])
    a, b, x = (tokenizer.convert_tokens_to_ids(t) for t in "abx")
    draft, allowed = c.restrict(Draft(torch.tensor([a, x, b])), 8)  # cut at x; nothing forced after "a"...
    text = tokenizer.decode(draft.tokens)
    assert text == "abc" or text.startswith("a") and "x" not in text, text
    assert allowed.shape == (len(draft) + 1, len(tokenizer)) and c.forced == len(draft) - 1
    tree = Draft(torch.tensor([a, x, b, x]), parents=torch.tensor([-1, -1, 0, 0]))  # a -> {b, x}; x forbidden
    kept, masks = c.restrict(tree, 8)
    assert tokenizer.decode(kept.tokens) == "ab" and kept.parents.tolist() == [-1, 0]
    assert bool(masks[1][b]) and not bool(masks[1][x]) and not bool(masks[0][b])
    assert c.allowed().nonzero().flatten().tolist() == c.raw_mask().nonzero().flatten().tolist()  # rolled back
    assert bool(c.allowed()[a])


# --- d) errors, CLI, server -----------------------------------------------------------------------------------

BAD = [({"json_schema": {"type": "integer", "minimum": 5, "maximum": 3}}, "Unsatisfiable schema"),
       ({"json_schema": {"type": "nope"}}, "nope"),
       ({"json_schema": "{not json"}, "not valid JSON"),
       ({"json_schema": [1, 2]}, "must be a JSON object"),
       ({"regex": "a(b"}, "regex cannot be compiled"),
       ({"regex": "[a-z]+", "json_schema": {}}, "exclude each other")]


@pytest.mark.parametrize("options,message", BAD)
def test_bad_schemas_and_regexes_are_one_line_user_errors(loaded_target, options, message):
    with pytest.raises(UserError, match=re.escape(message)) as e:
        Pipeline(loaded_target, None).generate("hi", max_new_tokens=4, **options)
    assert "\n" not in str(e.value)


def test_cli_reads_the_schema_file_and_refuses_bad_ones_in_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{oops")
    runner = CliRunner()
    for args, message in ((["--json-schema", str(bad)], "is not valid JSON"),
                          (["--json-schema", str(tmp_path / "missing.json")], "no such file"),
                          (["--json-schema", str(bad), "--regex", "a"], "not valid JSON")):
        result = runner.invoke(cli, ["generate", "hello", *args])
        assert result.exit_code == 2 and message in result.output, result.output
        assert len([line for line in result.output.splitlines() if line.strip()]) == 1, result.output


@pytest.fixture(scope="module")
def server(one_thread):
    target = LoadedModel(model=tiny_model("llama", seed=0), tokenizer=tiny_tokenizer(), name="tiny")
    draft = LoadedModel(model=perturbed(target.model, 0.05, seed=1), tokenizer=target.tokenizer, name="draft")
    pipe = Pipeline(target, build_drafter("draft-model", target, draft, 4, adaptive=False))
    with serving(create_app(Scheduler(lambda: pipe), model_name="tiny")) as url:
        yield url, pipe


def test_response_format_through_the_openai_client(server):
    url, pipe = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    schema = SCHEMAS["nested"]
    messages = [{"role": "user", "content": PROMPTS[0]}]
    fmt = {"type": "json_schema", "json_schema": {"name": "user", "schema": schema, "strict": True}}
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=N, temperature=0,
                                           response_format=fmt)
    pieces = client.chat.completions.create(model="tiny", messages=messages, max_tokens=N, temperature=0,
                                            response_format=fmt, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
    assert text == whole.choices[0].message.content and whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), schema)
    obj = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=N, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].text), dict)
    expected = pipe.generate_plain(PROMPTS[1], max_new_tokens=N, json_schema={"type": "object"}).text
    assert obj.choices[0].text == expected
    for bad in ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
                {"type": "json_schema", "json_schema": {"name": "x"}},
                {"type": "xml"}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, response_format=bad)
        assert e.value.status_code == 400
    with pytest.raises(openai.BadRequestError) as e:  # a streamed request is refused the same way
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, stream=True,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "x", "schema": {"type": "integer", "minimum": 3, "maximum": 1}}})
    assert "response_format" in str(e.value.body) or "minimum" in str(e.value)
    ok = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
    assert ok.choices[0].message.content is not None  # the server keeps serving


def test_a_draft_model_drafts_inside_the_grammar(loaded_target, plain_runs):
    """The draft model's logits are masked like the target's: a draft equal to the target proposes exactly the
    constrained output, so nearly every round commits k + 1 tokens. Unguided, its unconstrained argmax leaves the
    grammar within a token or two (whitespace, quotes) and the drafts are cut there."""
    same = LoadedModel(loaded_target.model, loaded_target.tokenizer, "same")
    pipe = Pipeline(loaded_target, build_drafter("draft-model", loaded_target, same, 4, adaptive=False))
    per_forward = []
    for i in (0, 1, 4):
        result = pipe.generate(PROMPTS[0], max_new_tokens=N, **CASES[i])
        assert result.token_ids == plain_runs[(i, PROMPTS[0])].token_ids
        assert result.stats.num_accepted_tokens == result.stats.num_draft_tokens > 0
        per_forward.append(result.stats.mean_accepted_tokens)
    assert min(per_forward) > 3.0, per_forward  # k + 1 = 5 a round (more with forced tokens); short outputs end early
