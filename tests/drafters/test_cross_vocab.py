"""Cross-vocabulary drafting: the byte-exact bridge between two tokenizers, and losslessness.

Two self-contained tokenizers trained on the same small corpus stand in for a real pair:
the target's is byte-level BPE (GPT-2 / Qwen style, `Ġ`), the draft's is SentencePiece style
(`▁`, a prepended space, byte-fallback `<0xNN>` tokens for characters it never saw, a BOS it
adds and the target does not). Two tiny Llama models, one per tokenizer, are trained for a few
seconds on the corpus, so they agree on the text they continue although no token id means the
same thing in both: the draft's proposals are really accepted, through the whole mapping.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from sparrow import sampling as S
from sparrow.config import SamplingConfig
from sparrow.drafters import build_drafter
from sparrow.drafters.cross_vocab import CrossVocabDrafter
from sparrow.drafters.token_bytes import TokenBytes, valid_utf8_prefix
from sparrow.models import LoadedModel
from sparrow.pipeline import Pipeline
from sparrow.policy.length import LengthPolicy
from sparrow.runtime.cached_model import CachedModel
from sparrow.types import Draft, Prompt, StepStats, Verdict

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "The quick brown fox jumps over the lazy dog. The dog sleeps.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "Un café crème, s'il vous plaît. Le café est très bon.",
    "Emoji: 😀 and 世界 mean smile and world.",
]
SPECIALS = ["<|im_start|>", "<|im_end|>"]
TRICKY = ["naïve café 😀 世界 ☃", "x  =  42\n\n\tdone", "<|im_start|>user\nhi<|im_end|>\n", "a" * 40,
          " leading space"]


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>", *SPECIALS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def sentencepiece_tokenizer(prepend_scheme: str = "never") -> PreTrainedTokenizerFast:
    """Metaspace BPE (Gemma 3 style; "first" = legacy Llama style, a space prepended to the text),
    byte fallback for unseen characters, and a BOS it inserts."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend_scheme)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", *SPECIALS], show_progress=False,
                                  limit_alphabet=45)  # rare characters (é, 😀, 世) only exist as bytes
    tok.train_from_iterator(TEXTS * 4, trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    data["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(data))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def trained_model(tokenizer, seed: int, steps: int, pad: int = 0) -> torch.nn.Module:
    """A tiny Llama that has memorised TEXTS in `tokenizer`'s tokens (`pad` unused logit rows)."""
    model = tiny_model("llama", seed=seed, vocab_size=len(tokenizer) + pad)
    eos = tokenizer.eos_token_id
    rows = [tokenizer(t)["input_ids"] + [eos] for t in TEXTS]
    width = max(map(len, rows))
    ids = torch.tensor([r + [eos] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    labels = ids.masked_fill(mask == 0, -100)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


@pytest.fixture(scope="module")
def target_tokenizer():
    return byte_level_tokenizer()


@pytest.fixture(scope="module")
def draft_tokenizer():
    return sentencepiece_tokenizer()


@pytest.fixture(scope="module")
def target(target_tokenizer) -> LoadedModel:
    return LoadedModel(trained_model(target_tokenizer, seed=0, steps=150), target_tokenizer, "tiny-target")


@pytest.fixture(scope="module")
def drafts(draft_tokenizer) -> dict[str, LoadedModel]:
    return {
        "trained": LoadedModel(trained_model(draft_tokenizer, seed=1, steps=150, pad=5), draft_tokenizer, "trained"),
        "half": LoadedModel(trained_model(draft_tokenizer, seed=2, steps=25, pad=5), draft_tokenizer, "half"),
        "random": LoadedModel(tiny_model("llama", seed=3, vocab_size=len(draft_tokenizer)), draft_tokenizer, "random"),
    }


# --- the byte-exact bridge -----------------------------------------------------------------------

def test_fixture_tokenizers_have_the_features_under_test(target_tokenizer, draft_tokenizer):
    draft = TokenBytes(draft_tokenizer)
    assert draft.adds_bos and draft.prefix == b"" and not TokenBytes(target_tokenizer).adds_bos
    tokens = draft_tokenizer.convert_ids_to_tokens(draft.encode("☃ café"))  # ☃ never seen in training
    assert tokens[:3] == ["<0xE2>", "<0x98>", "<0x83>"] and draft.join(draft.encode("☃")) == "☃".encode()
    assert "Ġ" in "".join(target_tokenizer.convert_ids_to_tokens(target_tokenizer.encode("a b")))


@pytest.mark.parametrize("side", ["target", "draft"])
@pytest.mark.parametrize("text", TEXTS + TRICKY)
def test_token_bytes_round_trip(side, text, target_tokenizer, draft_tokenizer):
    vocab = TokenBytes(target_tokenizer if side == "target" else draft_tokenizer)
    ids = vocab.encode(text)
    assert vocab.join(ids) == vocab.prefix + text.encode()
    assert vocab.encode_exact(text.encode(), at_start=True) == ids


def test_legacy_prepended_space_is_detected_and_kept_only_at_the_start(target, draft_tokenizer):
    legacy = sentencepiece_tokenizer("first")
    vocab = TokenBytes(legacy)
    assert vocab.prefix == b" "
    ids = vocab.encode("Paris is")
    assert vocab.join(ids) == b" Paris is" and vocab.encode_exact(b"Paris is", at_start=True) == ids
    context = vocab.encode("Paris is")
    more, covered = vocab.continuation(context, b" the capital")
    assert vocab.join(context + more) == b" Paris is the capital"[: len(vocab.join(context)) + covered]
    # a draft with such a tokenizer still drafts, and the output is still the target's
    draft = LoadedModel(tiny_model("llama", seed=4, vocab_size=len(legacy)), legacy, "legacy")
    pipe = Pipeline(target, build_drafter("cross-vocab", target, draft, 4, backoff=False))
    for prompt in ("<|im_start|>user\nhi", TEXTS[3][:20]):
        expected = pipe.generate_plain(prompt, max_new_tokens=12).token_ids
        assert pipe.generate(prompt, max_new_tokens=12).token_ids == expected


def test_split_characters_are_bytes_not_replacement_characters(target_tokenizer):
    vocab = TokenBytes(target_tokenizer)
    ids = vocab.encode("😀")
    assert len(ids) > 1 and vocab.join(ids) == "😀".encode()  # 4 bytes over several tokens
    assert target_tokenizer.decode(ids[:1]) == "\ufffd"  # what decode would have made of them
    assert valid_utf8_prefix("a😀".encode()[:3]) == b"a"


@pytest.mark.parametrize("side", ["target", "draft"])
def test_continuation_is_exact_at_every_cut(side, target_tokenizer, draft_tokenizer):
    """Cut texts at every byte (inside characters too): the tokens continuing the first part stand for
    exactly a prefix of the rest, and byte-level BPE, which has a token for every byte, covers all of it."""
    vocab = TokenBytes(target_tokenizer if side == "target" else draft_tokenizer)
    cuts = full = 0
    for text in ["Un café crème 😀, s'il vous plaît.", "def add(a, b):\n    return a + b\n", "<|im_end|>\nx 世界"]:
        data = text.encode()
        for cut in range(1, len(data)):
            context = byte_tokens(vocab, data[:cut])
            ids, covered = vocab.continuation(context, data[cut:])
            assert vocab.join(context) + vocab.join(ids) == data[: cut + covered], (text, cut)
            cuts += 1
            full += covered == len(data) - cut
    assert full == cuts if side == "target" else full > 0.5 * cuts


def byte_tokens(vocab: TokenBytes, data: bytes) -> list[int]:
    """Draft tokens for `data` at byte granularity where needed (context cut inside a character)."""
    ids, rest = [], data
    while rest:
        valid = valid_utf8_prefix(rest)
        if valid:
            ids += vocab.encode_exact(valid) or [vocab.by_bytes[bytes([c])] for c in valid]
            rest = rest[len(valid):]
        else:
            ids.append(vocab.by_bytes[rest[:1]])
            rest = rest[1:]
    return ids


def test_merge_across_the_boundary_falls_back_to_encoding_alone(target_tokenizer):
    vocab = TokenBytes(target_tokenizer)
    context = vocab.encode("The quick brown f")  # in context, "f" + "ox" would be one token " fox"
    ids, covered = vocab.continuation(context, b"ox jumps")
    assert covered == len(b"ox jumps") and vocab.join(ids) == b"ox jumps"


def test_special_tokens_map_by_content(target_tokenizer, draft_tokenizer):
    target, draft = TokenBytes(target_tokenizer), TokenBytes(draft_tokenizer)
    im_end = target_tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids, covered = draft.continuation([draft_tokenizer.bos_token_id], target.join([im_end]) + b"\n")
    assert ids[0] == draft_tokenizer.convert_tokens_to_ids("<|im_end|>") and covered == len(b"<|im_end|>\n")
    assert target.pieces[target_tokenizer.eos_token_id] == b"<eos>"
    assert draft.pieces[draft_tokenizer.bos_token_id] == b""  # a BOS the tokenizer inserts is no text


# --- the drafter's state across rounds --------------------------------------------------------------

def check_synced(drafter: CrossVocabDrafter) -> None:
    """The draft tokens stand for the committed bytes, but for an incomplete last character."""
    content = bytes(drafter._content)
    start = 1 if drafter.draft_vocab.adds_bos else 0
    assert drafter.draft_vocab.join(drafter._draft_ids[start:]) in (content[: drafter._synced],
                                                                     b" " + content[: drafter._synced])
    assert len(content) - drafter._synced < 4


def test_sync_keeps_the_draft_exact_over_rounds(target, drafts):
    """Commit target tokens the draft did not propose, cut inside characters and around specials."""
    drafter = build_drafter("cross-vocab", target, drafts["trained"], 4)
    tok = target.tokenizer
    greedy = SamplingConfig()
    prompt = tok.encode("<|im_start|>user\nSay it<|im_end|>\n<|im_start|>assistant\n")
    drafter.prefill(Prompt(input_ids=torch.tensor(prompt)))
    check_synced(drafter)
    committed = list(prompt)
    pieces = [tok.encode("Un café"), byte_tokens(drafter.target_vocab, " 😀 世".encode()), tok.encode("界."),
              tok.encode("<|im_end|>"), tok.encode("\nThe dog")]
    for i, new in enumerate(pieces):
        for j in range(0, len(new), 2):  # two tokens a round; byte tokens end rounds mid-character
            committed += new[j : j + 2]
            draft = drafter.propose(torch.tensor(committed), 8, greedy, None)
            check_synced(drafter)
            drafter.observe(draft, Verdict(tokens=torch.tensor([committed[-1]]), num_accepted=0), None,
                            StepStats(len(draft), 0, 0.0, 0.0))
            assert drafter.draft.length == len(drafter._cached)  # cut back lazily at the next draft


def test_draft_cache_is_cut_back_not_refilled(target, drafts, monkeypatch):
    drafter = build_drafter("cross-vocab", target, drafts["trained"], 4, backoff=False)
    pipe = Pipeline(target, drafter)
    prefills = []
    original = CachedModel.prefill
    monkeypatch.setattr(CachedModel, "prefill",
                        lambda self, prompt, *rest: prefills.append(self) or original(self, prompt, *rest))
    result = pipe.generate(TEXTS[2][:20], max_new_tokens=40)
    assert sum(p is drafter.draft for p in prefills) == 1  # the draft model was prefilled once
    assert result.stats.num_accepted_tokens > 0


# --- lossless --------------------------------------------------------------------------------------

PROMPTS = [TEXTS[0][:9], TEXTS[2][:15], TEXTS[4][:12], "<|im_start|>user\nEmoji: 😀", TEXTS[3][:30]]


@pytest.fixture(scope="module")
def baselines(target) -> dict[str, list[int]]:
    pipe = Pipeline(target, None)
    return {p: pipe.generate_plain(p, max_new_tokens=48).token_ids for p in PROMPTS}


@pytest.mark.parametrize("draft", ["trained", "half", "random"])
@pytest.mark.parametrize("k, options", [(2, {}), (4, {}), (8, {}), (8, {"adaptive": True}),
                                        (6, {"min_confidence": 0.3}), (8, {"backoff": True})])
def test_greedy_equals_plain(target, drafts, baselines, draft, k, options):
    options = {"backoff": False, **options}  # backoff decides from timings; acceptance is checked without it
    adaptive = options.pop("adaptive", False)
    pipe = Pipeline(target, build_drafter("cross-vocab", target, drafts[draft], k, adaptive, **options))
    drafted = accepted = 0
    for prompt in PROMPTS:
        result = pipe.generate(prompt, max_new_tokens=48)
        assert result.token_ids == baselines[prompt], (prompt, result.text)
        drafted += result.stats.num_draft_tokens
        accepted += result.stats.num_accepted_tokens
    if options["backoff"]:
        return
    if draft == "trained":  # a memorising pair agrees on much of the text (a random draft: about 0); the adaptive
        # length follows measured timings, so how much it drafts (and gets accepted) varies with the machine
        assert accepted >= (1 if adaptive else 10)
    if draft == "half" and "min_confidence" not in options:
        assert 0 < accepted < drafted  # partial acceptance: rejections and rollbacks happen


def test_greedy_with_the_rejection_verifier_and_short_budgets(target, drafts):
    pipe = Pipeline(target, build_drafter("cross-vocab", target, drafts["half"], 8), verifier="rejection")
    plain = Pipeline(target, None)
    for n in (1, 2, 5):
        for prompt in PROMPTS[:3]:
            expected = plain.generate_plain(prompt, max_new_tokens=n).token_ids
            assert pipe.generate(prompt, max_new_tokens=n).token_ids == expected


def test_backoff_skips_drafting_when_it_does_not_pay(target, drafts):
    drafter = build_drafter("cross-vocab", target, drafts["random"], 8, backoff=True)  # on by default when adaptive
    result = Pipeline(target, drafter).generate(PROMPTS[1], max_new_tokens=80)
    rounds_with_drafts = result.stats.drafted_per_position[0] if result.stats.drafted_per_position else 0
    assert rounds_with_drafts < result.stats.steps / 2  # mostly plain steps once nothing is accepted


def test_backoff_backs_off_and_probes():
    """The policy cross-vocab drafts with, on engine-like timings: a target round of n tokens costs
    0.1 + 0.0025 (n - 1) s, a draft step `step` s."""
    policy = LengthPolicy(8, backoff=True)  # exactly 8 steps, or none

    def round_(accepted: int, step: float) -> int:
        k = policy.cap(8)
        policy.observe(StepStats(k, min(k, accepted), step * k, 0.1 + 0.0025 * k))
        return k

    assert [round_(8, 0.005) for _ in range(20)] == [8] * 20  # a cheap draft (1/20 of a target round), always right
    caps = [round_(0, 0.005) for _ in range(60)]  # now it is always wrong
    off = caps.index(0)
    assert 0 < off < 40 and caps[off:off + 12] == [0, 0, 0, 8] + [0] * 7 + [8]  # backed off, probes, interval doubled
    for _ in range(20):  # a draft step as slow as a target round, right half the time: never pays
        policy.cap(8)
        policy.observe(StepStats(8, 1, 8 * 0.1, 0.12))
    assert 0.4 < policy.acceptance.value < 0.6 and policy.cap(8) == 0
    plain = policy.rate(0)
    assert plain == pytest.approx(10, rel=0.1) and max(policy.rate(k) for k in range(1, 9)) < plain


# --- sampling: the q = 1 rule keeps the target's distribution ----------------------------------------
# The first new token comes from the target's prefill; the next two go through drafting and the
# rejection verifier (a round may draft at most `remaining - 1` tokens), so the joint distribution of
# the first three new tokens checks verification. top_k = 3 keeps it to 27 cells.

N = 800


def exact_joint(model: torch.nn.Module, prompt: list[int], sampling: SamplingConfig,
                length: int = 3) -> dict[tuple[int, ...], float]:
    """P(t1, ..., t_length) of the first new tokens under `sampling`, from the target itself."""
    joint = {(): 1.0}
    with torch.no_grad():
        for _ in range(length):
            grown = {}
            for prefix, mass in joint.items():
                p = S.probs(model(input_ids=torch.tensor([prompt + list(prefix)])).logits[0, -1], sampling)
                for x in p.nonzero().flatten().tolist():
                    grown[(*prefix, x)] = mass * float(p[x])
            joint = grown
    return joint


class AcceptIfPossible:
    """Negative control: accepts each draft token the target gives any probability."""

    name = "accept-if-possible"

    def verify(self, draft: Draft, target_logits, sampling, generator) -> Verdict:
        p = S.probs(target_logits, sampling)
        tokens = draft.tokens.tolist()
        for i, x in enumerate(tokens):
            if p[i, x] <= 0:
                return Verdict(tokens=torch.tensor([*tokens[:i], int(S.sample(p[i], generator))]), num_accepted=i)
        return Verdict(tokens=torch.tensor([*tokens, int(S.sample(p[-1], generator))]), num_accepted=len(tokens))


def emitted(pipe: Pipeline, prompt: str, sampling: SamplingConfig) -> tuple[dict[tuple[int, ...], int], int]:
    counts: dict[tuple[int, ...], int] = {}
    accepted = 0
    for seed in range(N):
        result = pipe.generate(prompt, max_new_tokens=3, temperature=sampling.temperature, top_k=sampling.top_k,
                               seed=seed)
        key = tuple(result.token_ids)
        counts[key] = counts.get(key, 0) + 1
        accepted += result.stats.num_accepted_tokens
    return counts, accepted


def matches(counts: dict[tuple[int, ...], int], joint: dict[tuple[int, ...], float]) -> bool:
    if set(counts) - set(joint):
        return False
    return all(abs(counts.get(c, 0) - N * p) <= 6 * (N * p * (1 - p)) ** 0.5 + 5 for c, p in joint.items())


def test_sampling_preserves_the_target_distribution(target, drafts, monkeypatch):
    prompt = TEXTS[2][:15]
    pipe = Pipeline(target, build_drafter("cross-vocab", target, drafts["trained"], 3, backoff=False,
                                          min_confidence=0.0))
    ids = pipe.encode(prompt).input_ids.tolist()
    # the memorising target is sure of itself: the lowest temperature that spreads the distribution,
    # so that the check can tell rules apart
    sampling, joint = next((s, j) for t in (2.0, 4.0, 8.0, 16.0, 32.0) if max(
        (j := exact_joint(target.model, ids, s := SamplingConfig(temperature=t, top_k=3))).values()) < 0.5)
    counts, accepted = emitted(pipe, prompt, sampling)
    assert accepted > N / 4  # the draft's tokens were really verified, not just resampled
    assert matches(counts, joint), (counts, joint)
    import sparrow.pipeline

    monkeypatch.setattr(sparrow.pipeline, "build_verifier", lambda name, sampling, **_: AcceptIfPossible())
    assert not matches(emitted(pipe, prompt, sampling)[0], joint)  # negative control: the same check fails


# --- real presets (CI installs them for real_model tests) ------------------------------------------

@pytest.mark.real_model
@pytest.mark.parametrize("preset", ["qwen2.5-coder-0.5b", "smollm2-135m", "gemma3-270m"])
def test_real_tokenizers_are_byte_exact(preset):
    from sparrow.models import load_model

    tokenizer = load_model(preset, dtype="bfloat16", progress=False).tokenizer
    vocab = TokenBytes(tokenizer)
    for text in TRICKY + TEXTS:
        ids = vocab.encode(text)
        assert vocab.join(ids) == vocab.prefix + text.encode(), (preset, text)


@pytest.mark.real_model
def test_real_smollm2_drafts_for_qwen_losslessly():
    """smollm2-135m (49k vocabulary) drafts for qwen2.5-coder-0.5b (151k), float32, greedy."""
    from sparrow.models import load_model

    target = load_model("qwen2.5-coder-0.5b", dtype="bfloat16", progress=False)
    target.model.float()  # exactness: float32 arithmetic (the weights come from the bf16 cache)
    draft = load_model("smollm2-135m", dtype="float32", progress=False)
    pipe = Pipeline(target, build_drafter("cross-vocab", target, draft, 6, backoff=False))
    accepted = 0
    for prompt in ["Write a Python function that returns the square of a number.",
                   "Repeat exactly: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat."]:
        plain = pipe.generate_plain(prompt, max_new_tokens=32, chat=True)
        spec = pipe.generate(prompt, max_new_tokens=32, chat=True)
        assert spec.token_ids == plain.token_ids, (prompt, spec.text, plain.text)
        accepted += spec.stats.num_accepted_tokens
    assert accepted > 0
