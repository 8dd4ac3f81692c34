"""The int8 export of a head (sparrow.heads.int8): round trip, size bounds, logits close to the dense head's,
lossless decoding through it with drafts accepted, and damaged / foreign shards refused with a one-line UserError.

The head is an EAGLE-3 head with a reduced draft vocabulary trained briefly on the tiny target's own greedy
continuations (so drafts get accepted)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import CORPUS, continuations, tiny_model, tiny_tokenizer
from typer.testing import CliRunner

from sparrow.drafters import build_drafter
from sparrow.errors import UserError
from sparrow.heads import load_head, save_head
from sparrow.heads.eagle import EagleHead
from sparrow.heads.factory import new_head
from sparrow.heads.int8 import MANIFEST, dequantize_rows, quantize_rows, read_int8, write_int8
from sparrow.heads.layout import config_record, export_int8
from sparrow.models import LoadedModel
from sparrow.pipeline import Pipeline
from sparrow.training.heads import frequent_tokens, train_head

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
    export_int8(head, out)
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
    config, tensors = read_int8(exported)
    dense = head.state_dict()
    assert config == manifest["config"] and set(tensors) == set(dense)
    for name, tensor in dense.items():
        if tensor.is_floating_point() and tensor.ndim == 2:
            step = tensor.abs().amax(1, keepdim=True) / 127
            assert bool(((tensors[name] - tensor).abs() <= step / 2 + 1e-6).all()), name
        else:
            assert torch.equal(tensors[name], tensor), name  # norms, d2t, t2d as they are


def test_shards_and_total_are_bounded(head, tmp_path):
    written = write_int8(dict(head.state_dict()), config_record(head), tmp_path / "small", shard_bytes=8_000,
                         total_bytes=200_000)
    assert len(written.shard_bytes) > 3 and max(written.shard_bytes) <= 8_000 and written.total_bytes <= 200_000
    manifest = json.loads((tmp_path / "small" / MANIFEST).read_text())
    assert len(manifest["tensors"]["lm_head.weight"]["pieces"]) > 1  # cut along its rows
    _, tensors = read_int8(tmp_path / "small")
    _, whole = read_int8(export_int8(head, tmp_path / "whole").directory)
    assert all(torch.equal(tensors[k], whole[k]) for k in whole)
    with pytest.raises(UserError, match=r"over the 0 MB limit: train a smaller head"):
        write_int8(dict(head.state_dict()), config_record(head), tmp_path / "big", total_bytes=50_000)
    with pytest.raises(UserError, match="is not empty"):
        write_int8(dict(head.state_dict()), config_record(head), tmp_path / "small")


def test_the_dequantized_head_drafts_like_the_dense_one(target, head, exported):
    loaded = load_head(exported, target.model)
    assert loaded.config == head.config and loaded.fc.weight.dtype == torch.float32  # the target's dtype
    assert torch.equal(loaded.draft_to_target, head.draft_to_target)
    hidden = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    dense, small = head.draft_logits(hidden), loaded.draft_logits(hidden)
    assert float((dense - small).abs().max()) < 0.02 * float(dense.abs().max())
    assert float((dense.argmax(-1) == small.argmax(-1)).float().mean()) >= 0.9


def test_decoding_through_the_int8_head_is_lossless_with_drafts_accepted(target, exported):
    plain = Pipeline(target, None)
    pipe = Pipeline(target, build_drafter("eagle", target, None, 4, head=str(exported)))
    accepted = 0
    for prompt in PROMPTS:
        result = pipe.generate(prompt, max_new_tokens=30)
        assert result.token_ids == plain.generate_plain(prompt, max_new_tokens=30).token_ids
        accepted += result.stats.num_accepted_tokens
    assert accepted > 0


def test_a_dense_bf16_target_gets_the_head_in_bf16(head, exported):
    model = tiny_model("llama", seed=0).to(torch.bfloat16)
    assert load_head(exported, model).fc.weight.dtype == torch.bfloat16


def damaged_copy(exported, tmp_path, name: str):
    copy = tmp_path / name
    shutil.copytree(exported, copy)
    manifest = json.loads((copy / MANIFEST).read_text())
    return copy, copy / manifest["shards"][0]["file"]


def test_damaged_truncated_and_foreign_shards_are_refused(target, head, exported, tmp_path):
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
    other_dir = export_int8(other, tmp_path / "other").directory
    foreign, shard = damaged_copy(exported, tmp_path, "foreign")
    shutil.copy(next(other_dir.glob("*.safetensors")), shard)
    with pytest.raises(UserError, match="belongs to another head"):
        load_head(foreign, target.model)
    extra, shard = damaged_copy(exported, tmp_path, "extra")
    shutil.copy(shard, extra / "int8-00009-of-00009.safetensors")
    with pytest.raises(UserError, match=r"int8-00009-of-00009.safetensors is not in its manifest.json"):
        load_head(extra, target.model)
    missing, shard = damaged_copy(exported, tmp_path, "missing")
    shard.unlink()
    with pytest.raises(UserError, match="is missing"):
        load_head(missing, target.model)


def test_cli_export_int8_then_generate_with_it(target, head, tmp_path, monkeypatch):
    from sparrow.cli import app

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    target.model.save_pretrained(tmp_path / "target")
    target.tokenizer.save_pretrained(tmp_path / "target")
    save_head(head, tmp_path / "dense")
    runner = CliRunner()
    export = ["train", "export-int8", "--head", str(tmp_path / "dense"), "--out", str(tmp_path / "q")]
    result = runner.invoke(app, export)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["shards"] == 1
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
    result = runner.invoke(app, ["train", "export-int8", "--head", str(tmp_path / "q"), "--out", str(tmp_path / "q2")])
    assert result.exit_code == 2 and "already an int8 export" in result.output


def test_the_recipes_default_head_for_qwen2_5_coder_1_5b_fits_60_mb_in_4_shards(tmp_path):
    """The GPU recipe's default head shape for the 1.5B preset (hidden 1536, 12 / 2 heads, vocabulary 151,936;
    draft vocabulary 16,384, MLP 3,584) exports within the limits, so its 4 shards + manifest + eval.json +
    metrics.jsonl are the 7 files a device call returns."""
    from torch import nn

    from sparrow.heads.config import HeadConfig
    from sparrow.heads.eagle import TargetParts
    from sparrow.training.recipe import RecipeSettings

    defaults = RecipeSettings(out="", target="-")
    config = HeadConfig(arch="eagle3", hidden_size=1536, intermediate_size=defaults.intermediate_size,
                        num_attention_heads=12, num_key_value_heads=2, head_dim=128, vocab_size=151936,
                        draft_vocab_size=defaults.draft_vocab, target_layers=(2, 14, 25), target_hidden_size=1536)
    head = EagleHead(config, TargetParts(nn.Embedding(1, 1), nn.Linear(1, 1)), device="cpu", dtype=torch.float32)
    head.reset_parameters(torch.Generator().manual_seed(0))
    written = export_int8(head, tmp_path / "q")
    assert len(written.shard_bytes) == 4 and max(written.shard_bytes) <= 15_000_000
    assert written.total_bytes <= 60_000_000, written.total_bytes


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
