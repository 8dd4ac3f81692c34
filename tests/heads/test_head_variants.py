"""The seeds' head variants: Dovetail (gated fusion, deeper heads, device split), LongSpec, Sparrow.

a) Heads train briefly (module fixtures) on the tiny target's own greedy continuations, so drafts get accepted.
b) Lossless: float32 output equals plain greedy decoding token for token, chain and tree, with drafts accepted.
c) Dovetail: a gated / deeper head saves and loads (sparrow-only tensor names, `fusion: gated` in config.json);
   with the head on another device than the target only token ids and hidden states cross (two CPU placements
   here: "cpu" and "cpu:0" are different devices to torch, the same memory), and the head never calls the
   target's own modules.
d) LongSpec: chains and trees are lossless with drafts accepted; the head's own KV stays at its window while the
   context grows ~10x; its cross-attention reads the target's cache tensors in place; anchor-offset positions.
e) Sparrow (tiny Qwen2.5-VL and LLaVA-OneVision): lossless with drafts accepted; the head runs no row at a visual
   position, and its rows, attended keys and cache capacity are the same at 2 and at 8 frames.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import CORPUS, continuations, tiny_model, tiny_tokenizer
from safetensors.torch import load_file

from sparrow.drafters import build_drafter
from sparrow.errors import UserError
from sparrow.heads import load_head, save_head
from sparrow.heads.eagle import EagleHead
from sparrow.heads.factory import new_head
from sparrow.models import LoadedModel
from sparrow.pipeline import Pipeline
from sparrow.training.heads import frequent_tokens, train_head

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["The quick brown fox", "def add(a, b):", "Paris is the capital of France. Paris is"]
TRAIN_PROMPTS = [*sorted(set(CORPUS)), *PROMPTS, "for i in", "The dog", "Berlin is"]
NEW_TOKENS = 32
TREE = dict(tree_budget=10, tree_topk=3, tree_depth=5)
SPLIT_DEVICE = "cpu:0"  # another torch device than the target's "cpu", the same hardware
DOVETAIL = {"eagle3-gated-2": dict(arch="eagle3", fusion="gated", layers=2),
            "eagle1-gated-1": dict(arch="eagle1", fusion="gated", layers=1),
            "eagle1-concat-2": dict(arch="eagle1", fusion="concat", layers=2)}


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return LoadedModel(tiny_model("llama", seed=0), tiny_tokenizer(), "tiny")


@pytest.fixture(scope="module")
def sequences(target) -> list[torch.Tensor]:
    return continuations(target, TRAIN_PROMPTS)


@pytest.fixture(scope="module")
def baselines(target) -> dict[str, list[int]]:
    plain = Pipeline(target, None)
    return {p: plain.generate_plain(p, max_new_tokens=NEW_TOKENS).token_ids for p in PROMPTS}


@pytest.fixture(scope="module")
def dovetail(target, sequences) -> dict[str, EagleHead]:
    out = {}
    for name, options in DOVETAIL.items():
        generator = torch.Generator().manual_seed(0)
        vocab = frequent_tokens(sequences, 160, 320) if options["arch"] == "eagle3" else None
        head = new_head(target.model, generator=generator, draft_vocab=vocab, **options)
        report = train_head(head, target, sequences, steps=150, lr=3e-3, generator=generator, ttt_steps=3)
        assert sum(report.losses[-15:]) < sum(report.losses[:15]), name
        out[name] = head
    return out


def run_all(pipe: Pipeline, baselines: dict[str, list[int]], **options) -> tuple[int, int, int]:
    drafted = accepted = trees = 0
    for prompt in PROMPTS:
        result = pipe.generate(prompt, max_new_tokens=NEW_TOKENS, **options)
        assert result.token_ids == baselines[prompt], (prompt, result.stats)
        drafted += result.stats.num_draft_tokens
        accepted += result.stats.num_accepted_tokens
        trees += result.stats.tree_steps
    return drafted, accepted, trees


# Dovetail ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("name", list(DOVETAIL))
def test_dovetail_heads_are_lossless_with_drafts_accepted(target, dovetail, baselines, name, shape):
    head = dovetail[name]
    assert len(head.decoder_layers()) == DOVETAIL[name]["layers"]
    drafter = build_drafter("eagle", target, None, 5, head=head, **(TREE if shape == "tree" else {}))
    drafted, accepted, _ = run_all(Pipeline(target, drafter), baselines)
    assert 0 < accepted <= drafted


def test_gated_head_has_a_learned_gate(target):
    head = new_head(target.model, "eagle1", torch.Generator().manual_seed(0), fusion="gated")
    embeds, feature = torch.randn(3, 64), torch.randn(3, 64)
    mixed = head.gate(embeds, feature)
    token = torch.nn.functional.silu(head.gate.embed_proj(head.gate.embed_norm(embeds)))
    with torch.no_grad():
        head.gate.mix.bias.fill_(30.0)  # gate open: the feature alone
        assert torch.allclose(head.gate(embeds, feature), feature, atol=1e-5)
        head.gate.mix.bias.fill_(-30.0)  # gate shut: the token alone
        assert torch.allclose(head.gate(embeds, feature), token, atol=1e-5)
    assert not torch.allclose(mixed, feature) and not torch.allclose(mixed, token)
    assert head.fc.weight.shape == (64, 64)  # EAGLE-1 gated: fc projects the feature alone


@pytest.mark.parametrize("name", ["eagle3-gated-2", "eagle1-gated-1"])
def test_gated_and_deeper_heads_round_trip(target, dovetail, tmp_path, name):
    head = dovetail[name]
    save_head(head, tmp_path / "head")
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["fusion"] == "gated" and config["num_hidden_layers"] == DOVETAIL[name]["layers"]
    tensors = load_file(str(tmp_path / "head" / "model.safetensors"))
    assert {"gate.embed_norm.weight", "gate.embed_proj.weight", "gate.mix.weight", "gate.mix.bias"} <= set(tensors)
    if name.startswith("eagle3"):
        assert "layers.1.self_attn.q_proj.weight" in tensors and "midlayer.hidden_norm.weight" not in tensors
        assert tensors["midlayer.self_attn.q_proj.weight"].shape == (64, 64)  # reads the gate's d, not 2d
    loaded = load_head(tmp_path / "head", target.model)
    assert loaded.config == head.config
    for key, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], tensor), key
    pipe = lambda h: Pipeline(target, build_drafter("eagle", target, None, 4, head=h))  # noqa: E731
    runs = [[pipe(h).generate(p, max_new_tokens=16).stats.num_accepted_tokens for p in PROMPTS]
            for h in (head, loaded)]
    assert runs[0] == runs[1]


def test_bad_fusion_and_layers_are_refused(target):
    with pytest.raises(UserError, match="fusion must be one of concat, gated"):
        new_head(target.model, fusion="sum")
    with pytest.raises(UserError, match="at least 1 decoder layer"):
        new_head(target.model, layers=0)


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_device_split_moves_only_ids_and_hidden_states(target, dovetail, baselines, tmp_path, shape):
    save_head(dovetail["eagle1-gated-1"], tmp_path / "head")
    drafter = build_drafter("eagle", target, None, 4, head=str(tmp_path / "head"), draft_device=SPLIT_DEVICE,
                            **(TREE if shape == "tree" else {}))
    head, link = drafter.head, drafter.link
    assert link.split and link.draft == torch.device(SPLIT_DEVICE) and link.target == target.model.device
    # the head holds its own frozen copies of the target's embedding and (EAGLE-1) LM head
    target_pointers = {p.data_ptr() for p in target.model.parameters()}
    assert not {p.data_ptr() for p in head.parameters()} & target_pointers
    assert not {b.data_ptr() for b in head.target.embed.parameters()} & target_pointers
    assert head.target.lm_head is not target.model.get_output_embeddings()
    calls = []
    hook = target.model.get_input_embeddings().register_forward_hook(lambda *_: calls.append(1))
    try:
        pipe = Pipeline(target, drafter)
        steps = accepted = 0
        for prompt in PROMPTS:
            result = pipe.generate(prompt, max_new_tokens=NEW_TOKENS)
            assert result.token_ids == baselines[prompt]
            steps += 1 + result.stats.steps  # the prefill and the verification forwards
            accepted += result.stats.num_accepted_tokens
    finally:
        hook.remove()
    assert len(calls) == steps  # the target's embedding ran only inside the target's own forwards
    assert set(link.moved) == {"ids", "hidden"} and link.moved["hidden"] > 0, link.moved
    assert accepted > 0


def test_device_split_of_a_head_object_and_bad_devices(target, dovetail):
    head = new_head(target.model, "eagle3", torch.Generator().manual_seed(0), device=SPLIT_DEVICE)
    assert head.target.embed is not target.model.get_input_embeddings()
    drafter = build_drafter("eagle", target, None, 4, head=head, draft_device=SPLIT_DEVICE)
    assert drafter.link.split
    options = dict(max_new_tokens=12, temperature=0.8, seed=3)
    result = Pipeline(target, drafter).generate(PROMPTS[0], **options)
    assert result.token_ids == Pipeline(target, None).generate_plain(PROMPTS[0], **options).token_ids
    assert set(drafter.link.moved) == {"ids", "hidden", "probs"}  # a sampled chain also sends its q
    with pytest.raises(UserError, match="not a device torch knows"):
        build_drafter("eagle", target, None, 4, head=head, draft_device="warp-drive")


def test_cli_generate_with_draft_device(target, dovetail, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from sparrow.cli import app

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    target.model.save_pretrained(tmp_path / "target")
    target.tokenizer.save_pretrained(tmp_path / "target")
    save_head(dovetail["eagle3-gated-2"], tmp_path / "head")
    common = ["generate", PROMPTS[2], "--target", str(tmp_path / "target"), "--dtype", "float32", "--device", "cpu",
              "--max-new-tokens", "16", "--json"]
    result = CliRunner().invoke(app, [*common, "--drafter", "eagle", "--head", str(tmp_path / "head"),
                                      "--draft-device", SPLIT_DEVICE, "--compare"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["identical"] is True
    result = CliRunner().invoke(app, [*common, "--drafter", "prompt-lookup", "--draft-device", SPLIT_DEVICE])
    assert result.exit_code == 2 and "--draft-device applies to --drafter eagle only" in result.output


# LongSpec ------------------------------------------------------------------------------------------------------

WINDOW = 16


@pytest.fixture(scope="module")
def longspec(target, sequences):
    generator = torch.Generator().manual_seed(0)
    head = new_head(target.model, "longspec", generator, window=WINDOW)
    report = train_head(head, target, sequences, steps=300, lr=3e-3, generator=generator, anchor_offset=2000)
    assert sum(report.losses[-30:]) < sum(report.losses[:30])
    return head


def test_anchor_offset_positions_keep_sinks_and_shift_the_rest():
    from sparrow.training.loop import anchor_offset_positions

    assert torch.equal(anchor_offset_positions(10, 0, torch.Generator().manual_seed(0)), torch.arange(10))
    for seed in range(20):
        positions = anchor_offset_positions(50, 30_000, torch.Generator().manual_seed(seed), max_sink=4)
        shift = positions - torch.arange(50)
        sink = int((shift == 0).sum()) if int(shift[-1]) else 0
        assert sink <= 4 and bool((shift[:sink] == 0).all())
        assert bool((shift[sink:] == shift[-1]).all()) and 0 <= int(shift[-1]) <= 30_000  # one offset for the rest
        assert torch.equal(positions, anchor_offset_positions(50, 30_000, torch.Generator().manual_seed(seed)))
    shifts = {int(anchor_offset_positions(8, 30_000, torch.Generator().manual_seed(s))[-1]) for s in range(10)}
    assert len(shifts) > 5 and max(shifts) > 1000  # random, large


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_longspec_head_is_lossless_with_drafts_accepted(target, longspec, baselines, shape):
    drafter = build_drafter("eagle", target, None, 4, head=longspec, **(TREE if shape == "tree" else {}))
    assert drafter.hidden_layers == ()  # it reads the target's KV cache, not its hidden states
    drafted, accepted, trees = run_all(Pipeline(target, drafter), baselines)
    assert 0 < accepted <= drafted
    if shape == "chain":
        assert accepted / drafted > 0.2, (accepted, drafted)
    else:
        assert trees > 0
    assert drafter.cache.rows == WINDOW  # the tree's node rows are gone again; the window stays
    drafter = build_drafter("eagle", target, None, 4, head=longspec)
    options = dict(max_new_tokens=NEW_TOKENS, temperature=0.8, seed=1)
    expected = Pipeline(target, None).generate_plain(PROMPTS[2], **options).token_ids
    assert Pipeline(target, drafter).generate(PROMPTS[2], **options).token_ids == expected


def test_longspec_draft_memory_is_constant_as_the_context_grows(target, longspec):
    """The head's own KV holds `window` rows after every round at every context length (and < window + 2k while
    drafting k tokens), while the target's cache grows; the cross-attention reads the target's cache tensors in
    place."""
    drafter = build_drafter("eagle", target, None, 4, head=longspec)
    layer = longspec.config.kv_layer
    rows_after, peak, shared = [], [], []
    propose, forward = drafter.propose, longspec.cross_attn.forward

    def recording_propose(*args):
        draft = propose(*args)
        rows_after.append(drafter.cache.rows)
        assert drafter.cache.keys.shape[1] == drafter.cache.rows
        return draft

    def recording_forward(x, cos, sin, keys, values, mask):
        cached = drafter.target.cache.layers[layer]
        shared.append(keys.data_ptr() == cached.keys[0].data_ptr() and values.data_ptr() == cached.values[0].data_ptr())
        peak.append(drafter.cache.rows + x.shape[0])
        return forward(x, cos, sin, keys, values, mask)

    drafter.propose, longspec.cross_attn.forward = recording_propose, recording_forward
    try:
        pipe, plain = Pipeline(target, drafter), Pipeline(target, None)
        for repeats in (2, 8, 24):  # ~60, ~230, ~700 prompt tokens
            prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * repeats)
            rows_after.clear(), peak.clear()
            result = pipe.generate(prompt, max_new_tokens=24)
            assert result.token_ids == plain.generate_plain(prompt, max_new_tokens=24).token_ids
            assert drafter.target.length > 25 * repeats  # the target's cache grows with the context
            assert set(rows_after) == {WINDOW}, rows_after  # the head's does not
            assert max(peak) <= WINDOW - 1 + 2 * 4, peak  # window - 1 + (k + 1) committed + (k - 1) drafted
    finally:
        longspec.cross_attn.forward = forward
    assert shared and all(shared)  # no copy of the target's KV


def test_longspec_head_round_trips_and_refuses_what_it_cannot_do(target, longspec, tmp_path):
    save_head(longspec, tmp_path / "ls")
    config = json.loads((tmp_path / "ls" / "config.json").read_text())
    assert config["architectures"] == ["SparrowLongSpecHead"] and config["window"] == WINDOW
    loaded = load_head(tmp_path / "ls", target.model)
    assert loaded.config == longspec.config
    for key, tensor in longspec.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], tensor), key
    drafter = build_drafter("eagle", target, None, 4, head=str(tmp_path / "ls"))
    runs = [Pipeline(target, d).generate(PROMPTS[0], max_new_tokens=16).stats.num_accepted_tokens
            for d in (drafter, build_drafter("eagle", target, None, 4, head=longspec))]
    assert runs[0] == runs[1]
    with pytest.raises(UserError, match="another device"):
        build_drafter("eagle", target, None, 4, head=longspec, draft_device=SPLIT_DEVICE)
    other = tiny_model("llama", seed=1, vocab_size=400)
    with pytest.raises(UserError, match="vocabulary 320 .* the target's are 64, 400"):
        load_head(tmp_path / "ls", other)


def test_longspec_needs_a_full_attention_layer_to_read():
    from conftest import tiny_gemma3

    model = tiny_gemma3(6)  # five sliding-window layers, then one global
    gemma = LoadedModel(model, tiny_tokenizer(), "gemma")
    with pytest.raises(UserError, match="sliding_attention layer that keeps only a window"):
        build_drafter("eagle", gemma, None, 4, head=new_head(model, "longspec", kv_layer=0))
    assert build_drafter("eagle", gemma, None, 4, head=new_head(model, "longspec")).head.config.kv_layer == 5


# Sparrow (Video-LLMs) ------------------------------------------------------------------------------------------

TEXT_WINDOW = 16
QUESTIONS = ["What moves?", "Describe the video.", "What colour is the square?", "Count the frames."]


@pytest.fixture(scope="module", params=["qwen2.5-vl", "llava-onevision"])
def video_target(request):
    """A tiny Video-LLM and a Sparrow head trained briefly on its own answers about 4- and 8-frame videos."""
    from vlm_models import byte_tokenizer, moving_squares, tiny_processor, tiny_vlm

    from sparrow.heads.sparrow_head import video_features
    from sparrow.training.sparrow_head import train_sparrow
    from sparrow.vision.prompt import visual_token_ids
    from sparrow.vision.video import Video

    tok = byte_tokenizer()
    model = tiny_vlm(request.param, tok, seed=0)
    target = LoadedModel(model, tok, request.param, tiny_processor(request.param, tok))
    plain = Pipeline(target, None)
    generator = torch.Generator().manual_seed(0)
    head = new_head(model, "sparrow", generator, text_window=TEXT_WINDOW)
    features = []
    for question in QUESTIONS:
        for frames in (4, 8):
            video = Video.from_array(moving_squares(frames))
            prompt = plain.encode(question, video=video)
            answer = torch.tensor(plain.generate_plain(question, max_new_tokens=40, video=video).token_ids)
            features.append(video_features(model, head, prompt.input_ids, prompt.model_inputs, answer,
                                           visual_token_ids(model.config)))
    assert all(bool(f.visual.any()) for f in features)
    report = train_sparrow(head, features, steps=200, lr=3e-3, generator=generator)
    assert sum(report.losses[-20:]) < sum(report.losses[:20])
    return target, head


def video(frames: int):
    from vlm_models import moving_squares

    from sparrow.vision.video import Video

    return Video.from_array(moving_squares(frames))


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_sparrow_head_is_lossless_with_drafts_accepted(video_target, shape):
    target, head = video_target
    drafter = build_drafter("eagle", target, None, 4, head=head, **(TREE if shape == "tree" else {}))
    pipe, plain = Pipeline(target, drafter), Pipeline(target, None)
    accepted = trees = 0
    for question in QUESTIONS[:2]:
        for frames in (2, 8):
            result = pipe.generate(question, max_new_tokens=30, video=video(frames))
            assert result.token_ids == plain.generate_plain(question, max_new_tokens=30, video=video(frames)).token_ids
            accepted += result.stats.num_accepted_tokens
            trees += result.stats.tree_steps
    assert accepted > 0 and (trees > 0) == (shape == "tree")
    options = dict(max_new_tokens=24, temperature=0.8, seed=2, video=video(4))
    expected = plain.generate_plain(QUESTIONS[1], **options).token_ids
    assert pipe.generate(QUESTIONS[1], **options).token_ids == expected  # seeded sampling: the same tokens
    assert drafter.cache.rows <= TEXT_WINDOW


def test_sparrow_head_keeps_no_visual_kv_and_its_cost_does_not_grow_with_frames(video_target):
    """Every row the head runs is at a text position; its cache holds at most `text_window` rows between rounds
    and every row attends to at most `text_window` keys, at 2 and at 8 frames alike (a FLOP proxy: rows x keys)."""
    from sparrow.vision.prompt import visual_token_positions

    target, head = video_target
    drafter = build_drafter("eagle", target, None, 4, head=head)
    runs, rows_after = [], []
    run, propose = drafter._run, drafter.propose

    def recording_run(tokens, hidden, positions):
        before = drafter.keys_attended
        out = run(tokens, hidden, positions)
        runs.append((positions.tolist(), drafter.keys_attended - before))
        return out

    def recording_propose(*args):
        draft = propose(*args)
        rows_after.append((drafter.cache.rows, drafter.cache.keys.shape[1]))
        return draft

    drafter._run, drafter.propose = recording_run, recording_propose
    pipe = Pipeline(target, drafter)
    seen = {}
    for frames in (2, 8):
        runs.clear(), rows_after.clear()
        prompt = pipe.encode(QUESTIONS[0], video=video(frames))
        visual = set(visual_token_positions(prompt, target.model.config).tolist())
        pipe.generate(QUESTIONS[0], max_new_tokens=24, video=video(frames))
        assert visual and not visual & {p for positions, _ in runs for p in positions}  # no visual row, no visual KV
        assert all(rows <= TEXT_WINDOW for rows, _ in rows_after), rows_after
        assert all(keys <= TEXT_WINDOW * len(positions) for positions, keys in runs)
        seen[frames] = (len(visual), len(runs[0][0]), runs[0][1], max(capacity for _, capacity in rows_after))
    assert seen[8][0] > 2 * seen[2][0]  # four times the frames: many more visual tokens for the target ...
    assert seen[8][1:] == seen[2][1:], seen  # ... the same first-round rows, keys and cache capacity for the head


def test_sparrow_head_saves_as_eagle3_with_its_spec(video_target, tmp_path):
    target, head = video_target
    save_head(head, tmp_path / "sp")
    config = json.loads((tmp_path / "sp" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["sparrow"] == {"text_window": TEXT_WINDOW, "bridge_layer": 1}
    loaded = load_head(tmp_path / "sp", target.model)
    assert loaded.sparrow == head.sparrow and loaded.config == head.config
    drafter = build_drafter("eagle", target, None, 4, head=str(tmp_path / "sp"))
    assert type(drafter).__name__ == "SparrowDrafter"
    with pytest.raises(UserError, match="on the target's device"):
        build_drafter("eagle", target, None, 4, head=head, draft_device=SPLIT_DEVICE)
