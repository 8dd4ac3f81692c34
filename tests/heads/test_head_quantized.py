"""The int8 and int4 exports of a head (sparrow.heads.quantized): round trip, size bounds, logits close to the dense
head's, lossless decoding through them with drafts accepted, damaged / foreign shards refused with a one-line
UserError, an LM head equal to the target's rows left out, and the GPU recipe's default 1.5B head within 16 MB.

The head is an EAGLE-3 head with a reduced draft vocabulary trained briefly on the tiny target's own greedy
continuations (so drafts get accepted)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import CORPUS, continuations, tiny_model, tiny_tokenizer
from typer.testing import CliRunner

from sparrow.drafters import build_drafter
from sparrow.errors import UserError
from sparrow.heads import layout as layout_module
from sparrow.heads import load_head, save_head
from sparrow.heads.eagle import EagleHead
from sparrow.heads.factory import new_head
from sparrow.heads.layout import config_record, export_quantized
from sparrow.heads.quantized import (
    MANIFEST,
    dequantize_groups,
    dequantize_rows,
    quantize_groups,
    quantize_rows,
    read_quantized,
    write_quantized,
)
from sparrow.models import LoadedModel
from sparrow.pipeline import Pipeline
from sparrow.training.heads import extract_features, frequent_tokens, train_head, ttt_loss

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["The quick brown fox", "def add(a, b):", "Paris is the capital of France. Paris is"]


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return LoadedModel(tiny_model("llama", seed=0), tiny_tokenizer(), "tiny")


@pytest.fixture(scope="module")
def head(target) -> EagleHead:
    sequences = continuations(target, [*sorted(set(CORPUS)), *PROMPTS, "for i in", "The dog"])
    generator = torch.Generator().manual_seed(0)
    head = new_head(target.model, "eagle3", generator, draft_vocab=frequent_tokens(sequences, 160, 320))
    train_head(head, target, sequences, steps=150, lr=3e-3, generator=generator, ttt_steps=3)
    return head


@pytest.fixture(scope="module")
def exported(head, tmp_path_factory):
    out = tmp_path_factory.mktemp("int8") / "head"
    export_quantized(head, out)
    return out


def test_per_row_quantization_is_symmetric_and_bounded():
    w = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    w[2] = 0.0
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and scale.shape == (6,) and int(q.abs().max()) <= 127
    assert torch.equal(q[2], torch.zeros(50, dtype=torch.int8))
    assert torch.allclose(scale[0], w[0].abs().max() / 127)
    assert bool(((dequantize_rows(q, scale) - w).abs() <= scale[:, None] / 2 + 1e-7).all())


def test_the_export_round_trips(head, exported):
    manifest = json.loads((exported / MANIFEST).read_text())
    assert manifest["format"] == "sparrow-head-int8" and manifest["version"] == 1
    assert manifest["config"] == {**config_record(head), "sparrow_format": 2}
    for record in manifest["shards"]:
        assert (exported / record["file"]).stat().st_size == record["bytes"] and len(record["sha256"]) == 64
    entries = manifest["tensors"]
    assert entries["lm_head.weight"]["scale"] is not None and entries["norm.weight"]["scale"] is None
    config, tensors = read_quantized(exported)
    dense = head.state_dict()
    assert config == manifest["config"] and set(tensors) == set(dense)
    for name, tensor in dense.items():
        if tensor.is_floating_point() and tensor.ndim == 2:
            step = tensor.abs().amax(1, keepdim=True) / 127
            assert bool(((tensors[name] - tensor).abs() <= step / 2 + 1e-6).all()), name
        else:
            assert torch.equal(tensors[name], tensor), name  # norms, d2t, t2d as they are


@pytest.mark.parametrize("bits", [8, 4])
def test_shards_and_total_are_bounded(head, tmp_path, bits):
    written = write_quantized(dict(head.state_dict()), config_record(head), tmp_path / "small", bits=bits,
                              shard_bytes=8_000, total_bytes=200_000)
    assert len(written.shard_bytes) > 3 and max(written.shard_bytes) <= 8_000 and written.total_bytes <= 200_000
    manifest = json.loads((tmp_path / "small" / MANIFEST).read_text())
    assert any(len(entry["pieces"]) > 1 for entry in manifest["tensors"].values())  # cut along its rows
    for name, entry in manifest["tensors"].items():  # a scale never cut: one piece, whole
        assert entry["scale"] is None or entry["scale"][1] == name + ".scale", name
    _, tensors = read_quantized(tmp_path / "small")
    _, whole = read_quantized(export_quantized(head, tmp_path / "whole", bits=bits).directory)
    assert all(torch.equal(tensors[k], whole[k]) for k in whole)
    with pytest.raises(UserError, match=r"over the 0 MB limit: train a smaller head"):
        write_quantized(dict(head.state_dict()), config_record(head), tmp_path / "big", total_bytes=50_000)
    with pytest.raises(UserError, match="is not empty"):
        write_quantized(dict(head.state_dict()), config_record(head), tmp_path / "small")


def test_the_dequantized_head_drafts_like_the_dense_one(target, head, exported):
    loaded = load_head(exported, target.model)
    assert loaded.config == head.config and loaded.fc.weight.dtype == torch.float32  # the target's dtype
    assert torch.equal(loaded.draft_to_target, head.draft_to_target)
    hidden = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    dense, small = head.draft_logits(hidden), loaded.draft_logits(hidden)
    assert float((dense - small).abs().max()) < 0.02 * float(dense.abs().max())
    assert float((dense.argmax(-1) == small.argmax(-1)).float().mean()) >= 0.9


def test_a_dense_bf16_target_gets_the_head_in_bf16(head, exported):
    model = tiny_model("llama", seed=0).to(torch.bfloat16)
    assert load_head(exported, model).fc.weight.dtype == torch.bfloat16


def damaged_copy(exported, tmp_path, name: str):
    copy = tmp_path / name
    shutil.copytree(exported, copy)
    manifest = json.loads((copy / MANIFEST).read_text())
    return copy, copy / manifest["shards"][0]["file"]


@pytest.mark.parametrize("bits", [8, 4])
def test_damaged_truncated_and_foreign_shards_are_refused(target, head, request, tmp_path, bits):
    exported = request.getfixturevalue("exported" if bits == 8 else "exported4")
    flipped, shard = damaged_copy(exported, tmp_path, "flipped")
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"fails its sha256 check \(damaged\)"):
        load_head(flipped, target.model)
    truncated, shard = damaged_copy(exported, tmp_path, "truncated")
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(UserError, match=r"has \d+ bytes, its manifest says \d+ \(truncated or damaged\)"):
        build_drafter("eagle", target, None, 4, head=str(truncated))
    other = new_head(target.model, "eagle3", torch.Generator().manual_seed(9), draft_vocab=head.draft_to_target)
    other_dir = export_quantized(other, tmp_path / "other", bits=bits).directory
    foreign, shard = damaged_copy(exported, tmp_path, "foreign")
    shutil.copy(next(other_dir.glob("*.safetensors")), shard)
    with pytest.raises(UserError, match="belongs to another head"):
        load_head(foreign, target.model)
    extra, shard = damaged_copy(exported, tmp_path, "extra")
    shutil.copy(shard, extra / f"int{bits}-00009-of-00009.safetensors")
    with pytest.raises(UserError, match=rf"int{bits}-00009-of-00009.safetensors is not in its manifest.json"):
        load_head(extra, target.model)
    missing, shard = damaged_copy(exported, tmp_path, "missing")
    shard.unlink()
    with pytest.raises(UserError, match="is missing"):
        load_head(missing, target.model)


@pytest.mark.parametrize("bits", [8, 4])
def test_cli_export_then_generate_with_it(target, head, tmp_path, monkeypatch, bits):
    from sparrow.cli import app

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    target.model.save_pretrained(tmp_path / "target")
    target.tokenizer.save_pretrained(tmp_path / "target")
    save_head(head, tmp_path / "dense")
    runner = CliRunner()
    export = ["train", f"export-int{bits}", "--head", str(tmp_path / "dense"), "--out", str(tmp_path / "q")]
    result = runner.invoke(app, export)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["shards"] == 1 and json.loads(result.stdout)["bits"] == bits
    assert next((tmp_path / "q").glob(f"int{bits}-00001-of-00001.safetensors"))
    common = ["generate", PROMPTS[2], "--target", str(tmp_path / "target"), "--dtype", "float32", "--device", "cpu",
              "--max-new-tokens", "20", "--json", "--drafter", "eagle"]
    result = runner.invoke(app, [*common, "--head", str(tmp_path / "q"), "--compare"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["identical"] is True and record["stats"]["num_accepted_tokens"] > 0
    shard = next((tmp_path / "q").glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-1])
    result = runner.invoke(app, [*common, "--head", str(tmp_path / "q")])
    assert result.exit_code == 2 and "truncated or damaged" in result.output and "Traceback" not in result.output
    result = runner.invoke(app, ["train", "export-int4", "--head", str(tmp_path / "q"), "--out", str(tmp_path / "q2")])
    assert result.exit_code == 2 and "already a quantized export" in result.output


# int4 in groups, the compact export (issue #42 item 1) ----------------------------------------------------------


@pytest.fixture(scope="module")
def exported4(head, tmp_path_factory):
    out = tmp_path_factory.mktemp("int4") / "head"
    export_quantized(head, out, bits=4)
    return out


def test_int4_groups_are_symmetric_bounded_and_padded():
    w = torch.randn(5, 150, generator=torch.Generator().manual_seed(0))  # 150 = 2 groups of 64 + 22, padded
    w[1, :64] = 0.0
    packed, scale = quantize_groups(w, 64)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 96) and scale.dtype == torch.float16
    assert scale.shape == (5, 3) and float(scale[1, 0]) == 1.0  # a zero group: scale 1, all codes 8 (= 0)
    assert bool((packed[1, :32] == 0x88).all())
    back = dequantize_groups(packed, scale, 150)
    assert back.shape == (5, 150) and torch.equal(back[1, :64], torch.zeros(64))
    step = scale.float().repeat_interleave(64, 1)[:, :150]
    assert bool(((back - w).abs() <= step / 2 + 1e-6).all())
    peak = w[0, :64].abs().argmax()
    assert float(back[0, peak].abs()) == pytest.approx(float(w[0, peak].abs()), rel=1e-3)  # the peak: code +-7
    with pytest.raises(UserError, match="even number"):
        quantize_groups(w, 63)


def test_the_int4_export_round_trips_and_drafts_close_to_the_dense_head(target, head, exported, exported4):
    manifest = json.loads((exported4 / MANIFEST).read_text())
    assert manifest["format"] == "sparrow-head-int4" and manifest["tensors"]["fc.weight"]["group"] == 64
    assert all(r["file"].startswith("int4-") for r in manifest["shards"])
    _, tensors = read_quantized(exported4)
    for name, tensor in head.state_dict().items():
        if not (tensor.is_floating_point() and tensor.ndim == 2):
            assert torch.equal(tensors[name], tensor), name
    features = extract_features(target, head.config.target_layers, continuations(target, PROMPTS), top_k=8)
    hidden = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))  # the LM head alone (one group a row)
    dense = head.draft_logits(hidden).detach()
    with torch.no_grad():  # the whole head on the target's features: top-1 agreement with the target per depth
        before = torch.tensor([list(ttt_loss(head, f, 3)[1]) for f in features]).mean(0)
    measured = {}
    for name, directory in (("int8", exported), ("int4", exported4)):
        loaded = load_head(directory, target.model)
        assert loaded.config == head.config
        small = loaded.draft_logits(hidden).detach()
        error = float((dense - small).abs().max()) / float(dense.abs().max())
        agree = float((dense.argmax(-1) == small.argmax(-1)).float().mean())
        with torch.no_grad():
            after = torch.tensor([list(ttt_loss(loaded, f, 3)[1]) for f in features]).mean(0)
        measured[name] = (error, agree, after)
        print(f"{name}: LM-head logits max error {error:.4f} of the largest, argmax agreement {agree:.3f}; agreement "
              f"by depth {[round(float(a), 3) for a in after]} (dense {[round(float(a), 3) for a in before]})")
    error, agree, after = measured["int4"]
    assert error < 0.15 and agree >= 0.7, (error, agree)  # measured 0.096, 0.78 (int8: 0.006, 0.98)
    assert bool(((before - after).abs() <= 0.05).all()), (before, after)
    int8_dir = export_quantized(head, exported4.parent / "as-int8").directory
    assert sum(p.stat().st_size for p in exported4.glob("*.safetensors")) < 0.6 * sum(
        p.stat().st_size for p in int8_dir.glob("*.safetensors"))


def test_decoding_through_the_int8_and_int4_heads_is_lossless_with_drafts_accepted(target, head, exported, exported4,
                                                                                  tmp_path):
    plain = Pipeline(target, None)
    save_head(head, tmp_path / "dense")
    accepted = {}
    for name, directory in (("dense", tmp_path / "dense"), ("int8", exported), ("int4", exported4)):
        pipe = Pipeline(target, build_drafter("eagle", target, None, 4, head=str(directory)))
        accepted[name] = 0
        for prompt in PROMPTS:
            result = pipe.generate(prompt, max_new_tokens=30)
            assert result.token_ids == plain.generate_plain(prompt, max_new_tokens=30).token_ids
            accepted[name] += result.stats.num_accepted_tokens
    print(f"drafts accepted over 3 prompts x 30 tokens: {accepted}")
    assert accepted["int8"] > 0 and accepted["int4"] > 0.8 * accepted["dense"]


def test_an_lm_head_equal_to_the_targets_rows_is_left_out_and_taken_from_the_target(target, head, tmp_path):
    from sparrow.training.heads import init_from_target

    frozen = new_head(target.model, "eagle3", torch.Generator().manual_seed(3), draft_vocab=head.draft_to_target)
    init_from_target(frozen, target.model)  # the LM head as a run with it frozen keeps it
    written = export_quantized(frozen, tmp_path / "frozen", bits=4)
    manifest = json.loads((written.directory / MANIFEST).read_text())
    assert "lm_head.weight" not in manifest["tensors"] and manifest["config"]["sparrow_lm_head"] == "target"
    loaded = load_head(written.directory, target.model)
    rows = target.model.get_output_embeddings().weight[head.draft_to_target]
    assert torch.equal(loaded.lm_head.weight, rows)  # exact: the target's rows, not quantized
    with_lm_head = export_quantized(head, tmp_path / "trained", bits=4)  # a trained LM head is stored
    assert written.total_bytes < with_lm_head.total_bytes
    assert "lm_head.weight" in json.loads((with_lm_head.directory / MANIFEST).read_text())["tensors"]


def test_the_recipes_default_head_for_qwen2_5_coder_1_5b_fits_16_mb_at_int4(tmp_path):
    """The GPU recipe's default head for the 1.5B preset (hidden 1536, 12 / 2 heads, vocabulary 151,936; draft
    vocabulary 16,384, MLP 2,816, its LM head the target's rows, frozen) exports at int4 within 16 MB: what a device
    call can carry beside the tree, and what the repository keeps in src/sparrow/heads/shipped/."""
    from torch import nn

    from sparrow.heads.config import HeadConfig
    from sparrow.heads.eagle import TargetParts
    from sparrow.training.recipe import RecipeSettings

    defaults = RecipeSettings(out="", target="-")
    assert not defaults.train_lm_head
    config = HeadConfig(arch="eagle3", hidden_size=1536, intermediate_size=defaults.intermediate_size,
                        num_attention_heads=12, num_key_value_heads=2, head_dim=128, vocab_size=151936,
                        draft_vocab_size=defaults.draft_vocab, target_layers=(2, 14, 25), target_hidden_size=1536)
    head = EagleHead(config, TargetParts(nn.Embedding(1, 1), nn.Linear(1, 1)), device="cpu", dtype=torch.float32)
    head.reset_parameters(torch.Generator().manual_seed(0))
    tensors = {k: v for k, v in head.state_dict().items() if k != "lm_head.weight"}  # as export_quantized leaves it
    record = {**config_record(head), "sparrow_lm_head": "target"}
    written = write_quantized(tensors, record, tmp_path / "q", bits=4)
    print(f"default 1.5B head at int4: {written.total_bytes:,} bytes in {len(written.shard_bytes)} shards")
    assert written.total_bytes <= 16_000_000 and max(written.shard_bytes) <= 15_000_000
    _, back = read_quantized(tmp_path / "q")
    error = max(float((back[k] - v).abs().max() / v.abs().max()) for k, v in tensors.items() if v.ndim == 2)
    assert error < 0.08  # half a step of a group's 15 levels, at most 1/14 of a matrix's largest weight
    with pytest.raises(UserError, match="over the 16 MB limit"):  # its LM head stored too: no longer fits
        write_quantized(dict(head.state_dict()), config_record(head), tmp_path / "big", bits=4)


SHIPPED_DIRS = sorted(p for p in (Path(layout_module.__file__).parent / "shipped").iterdir() if p.is_dir())


@pytest.mark.parametrize("directory", SHIPPED_DIRS, ids=[p.name for p in SHIPPED_DIRS])
def test_every_shipped_head_is_a_whole_export_within_16_mb_for_its_preset(directory):
    """Each head in src/sparrow/heads/shipped/<preset>/ verifies (every shard's size and sha256), fits 16 MB, and
    names a preset (decoding through it needs that preset's target: tests/test_real_model.py, where installed)."""
    from sparrow.heads.quantized import verify_quantized
    from sparrow.models.presets import PRESETS

    manifest = verify_quantized(directory)
    assert directory.name in PRESETS
    assert sum(r["bytes"] for r in manifest["shards"]) <= 16_000_000
    assert sorted(p.name for p in directory.iterdir()) == sorted([MANIFEST, *(r["file"] for r in manifest["shards"])])


SHIPPED_PROMPTS = ("Write a Python function `is_prime(n)` that checks whether n is a prime number.",
                   "Explain in two sentences what a hash table is.")


@pytest.mark.real_model
@pytest.mark.parametrize("directory", SHIPPED_DIRS, ids=[p.name for p in SHIPPED_DIRS])
def test_every_shipped_head_decodes_its_preset_losslessly_with_drafts_accepted(directory):
    """`--drafter eagle` without `--head` on the preset's target (its GGUF blocks: rows are batch-invariant, so a
    verify computes what one-token steps do) takes the shipped head, and its greedy output equals plain decoding
    token for token with drafts accepted (`make test` installs every preset a head is shipped for)."""
    import sparrow
    from sparrow.models.gguf_native import load_gguf_model
    from sparrow.models.presets import PRESETS, is_installed

    if not is_installed(PRESETS[directory.name]):
        pytest.skip(f"preset {directory.name} not installed (make test installs it)")
    target = load_gguf_model(directory.name, progress=False)
    from sparrow.heads.layout import find_head

    assert find_head(directory.name) == directory
    pipe = sparrow.load(target, drafter="eagle", draft=None, progress=False)
    assert torch.equal(pipe.drafter.head.fc.weight, load_head(directory, target.model).fc.weight)  # the shipped one
    accepted = 0
    for prompt in SHIPPED_PROMPTS:
        spec = pipe.generate(prompt, max_new_tokens=40, chat=True)
        assert spec.token_ids == pipe.generate_plain(prompt, max_new_tokens=40, chat=True).token_ids, prompt
        accepted += spec.stats.num_accepted_tokens
    assert accepted > 0


# shipping: a head in the package, found before the user cache (issue #28 item 6) ---------------------------------


@pytest.fixture
def shipped(exported, tmp_path, monkeypatch):
    """`exported` shipped for the preset name smollm2-135m (the package's shipped dir moved to tmp_path); an
    untrained head in the user cache for the same preset."""
    from sparrow.heads import layout

    monkeypatch.setattr(layout, "SHIPPED", tmp_path / "shipped")
    monkeypatch.setenv("SPARROW_CACHE", str(tmp_path / "cache"))
    shutil.copytree(exported, tmp_path / "shipped" / "smollm2-135m")
    return tmp_path / "shipped" / "smollm2-135m"


def test_eagle_without_head_uses_the_shipped_head_before_the_users(target, head, shipped, tmp_path):
    from sparrow.heads import default_head_dir
    from sparrow.heads.layout import find_head

    as_preset = LoadedModel(target.model, target.tokenizer, "smollm2-135m")
    untrained = new_head(target.model, "eagle3", torch.Generator().manual_seed(7), draft_vocab=head.draft_to_target)
    save_head(untrained, default_head_dir("smollm2-135m"))
    assert find_head("smollm2-135m") == shipped and find_head("tiny") is None
    assert find_head(str(shipped)) is None  # a path is no preset (a model directory has a config.json too)
    drafter = build_drafter("eagle", as_preset, None, 4)
    assert torch.equal(drafter.head.fc.weight, load_head(shipped, target.model).fc.weight)
    shutil.rmtree(shipped)
    assert find_head("smollm2-135m") == default_head_dir("smollm2-135m")  # then the user's
    assert torch.equal(build_drafter("eagle", as_preset, None, 4).head.fc.weight, untrained.fc.weight)


def test_auto_counts_an_available_head_among_its_candidates_and_stays_lossless(target, shipped):
    """auto drafts with the head in some rounds; in the others (plain steps, prompt lookup) the head still takes
    the target's features of the committed rows, so its cache equals one computed from the whole text at once."""
    from sparrow.heads.eagle import causal_mask

    as_preset = LoadedModel(target.model, target.tokenizer, "smollm2-135m")
    drafter = build_drafter("auto", as_preset, None, 4)
    assert "eagle" in drafter.candidates and drafter.hidden_layers == drafter.candidates["eagle"].hidden_layers
    assert "eagle" not in build_drafter("auto", as_preset, None, 4, eagle=False).candidates  # left out when asked
    plain, pipe = Pipeline(as_preset, None), Pipeline(as_preset, drafter)
    eagle = drafter.candidates["eagle"]
    head = eagle.head
    for prompt in PROMPTS:
        result = pipe.generate(prompt, max_new_tokens=40)
        expected = plain.generate_plain(prompt, max_new_tokens=40).token_ids
        assert result.token_ids == expected
        assert "eagle" in drafter.choices or prompt == PROMPTS[2], drafter.choices  # probed (lookup wins repeats)
        text = torch.cat([plain.encode(prompt).input_ids, torch.tensor(expected)])
        fed, pending = eagle.runner.target_rows, eagle.runner.pending
        assert fed + pending.shape[0] == text.numel() - 1  # every committed row's features, whoever drafted
        states = as_preset.model(input_ids=text[None], output_hidden_states=True).hidden_states
        features = torch.cat([states[i][0, : text.numel() - 1] for i in head.config.target_layers], -1)
        assert torch.allclose(pending, features[fed:], atol=1e-4)
        if fed:  # the rows the head ran when it drafted: as from the whole text at once
            out, _, _ = head.step(text[1 : fed + 1], head.fuse(features[:fed]), torch.arange(fed),
                                  causal_mask(fed, 0, "cpu"), None)
            assert torch.allclose(eagle.runner.cache.hidden[:fed], out, atol=1e-4)
    assert sum(r.choice == "eagle" for r in drafter.rounds) == 0 and fed == 0  # the last prompt: lookup throughout


def test_bench_eagle_without_head_runs_the_shipped_head(shipped, monkeypatch, tmp_path):
    from sparrow.bench import command
    from sparrow.bench.data import DEFAULT_DATA

    seen = {}

    def stop(config, progress=True):
        seen["head"] = config.head
        raise RuntimeError("stop before loading models")

    monkeypatch.setattr(command, "load_models", stop)
    with pytest.raises(RuntimeError, match="stop before loading"):
        command.run(data=DEFAULT_DATA, methods="eagle",
                    categories=None, limit=1, per_task=None, max_new_tokens=4, repeats=1, first_repeat=0, warmup=0,
                    all_turns=False, target="smollm2-135m", draft="none", cross_draft="none", k=None, adaptive=False,
                    dtype="float32", device="cpu", quant=None, draft_quant=None, lookup_tokens=2, chat=False,
                    out=tmp_path / "bench", quick=False, progress=False)
    assert seen["head"] == str(shipped)
