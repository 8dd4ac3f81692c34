"""EAGLE heads: the SpecForge / vLLM checkpoint layout, losslessness, reduced vocabularies, training.

a) Heads are trained first (module fixture, a few hundred cheap steps) on the tiny target's own greedy
   continuations, so drafts get accepted; the EAGLE-3 head has a reduced draft vocabulary (FR-Spec).
b) Lossless: for eagle3 and eagle1, chain and tree, greedy and rejection verifiers, float32 output equals
   plain greedy decoding token for token, with drafts accepted; seeded sampling equals seeded plain decoding.
c) Layout: a saved head round-trips (tensors, config, drafts); a checkpoint written by hand with SpecForge's
   key names and config loads and drafts; a head that does not fit the target is refused naming both sizes.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import CORPUS, continuations, tiny_model, tiny_tokenizer
from safetensors.torch import load_file, save_file

from sparrow.decoding.engine import speculative_decode
from sparrow.drafters import build_drafter
from sparrow.errors import UserError
from sparrow.heads import load_head, save_head
from sparrow.heads.eagle import EagleHead, causal_mask
from sparrow.heads.factory import new_head
from sparrow.models import LoadedModel
from sparrow.pipeline import Pipeline
from sparrow.stopping import Stopper
from sparrow.training.heads import evaluate, extract_features, frequent_tokens, train_head
from sparrow.training.loop import TrainReport
from sparrow.verifiers import build_verifier

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["The quick brown fox", "def add(a, b):", "Paris is the capital of France. Paris is"]
TRAIN_PROMPTS = [*sorted(set(CORPUS)), *PROMPTS, "for i in", "The dog", "Berlin is"]
HELD_OUT = ["Speculative decoding drafts", "print(i"]
NEW_TOKENS = 40
DRAFT_VOCAB = 160  # of the tiny target's 320
SPECFORGE_KEYS = {
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    *(f"midlayer.{norm}.weight" for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm")),
    *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
}


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return LoadedModel(tiny_model("llama", seed=0), tiny_tokenizer(), "tiny")


@pytest.fixture(scope="module")
def sequences(target) -> list[torch.Tensor]:
    return continuations(target, TRAIN_PROMPTS)


@pytest.fixture(scope="module")
def trained(target, sequences) -> dict[str, tuple[EagleHead, TrainReport]]:
    out = {}
    for arch in ("eagle3", "eagle1"):
        generator = torch.Generator().manual_seed(0)
        vocab = frequent_tokens(sequences, DRAFT_VOCAB, 320) if arch == "eagle3" else None
        head = new_head(target.model, arch, generator, draft_vocab=vocab)
        out[arch] = head, train_head(head, target, sequences, steps=250, lr=3e-3, generator=generator, ttt_steps=3)
    return out


@pytest.fixture(scope="module")
def baselines(target) -> dict[str, list[int]]:
    plain = Pipeline(target, None)
    return {p: plain.generate_plain(p, max_new_tokens=NEW_TOKENS).token_ids for p in PROMPTS}


def run_all(pipe: Pipeline, baselines: dict[str, list[int]], **options) -> tuple[int, int, int]:
    drafted = accepted = trees = 0
    for prompt in PROMPTS:
        result = pipe.generate(prompt, max_new_tokens=NEW_TOKENS, **options)
        assert result.token_ids == baselines[prompt], (prompt, result.stats)
        drafted += result.stats.num_draft_tokens
        accepted += result.stats.num_accepted_tokens
        trees += result.stats.tree_steps
    return drafted, accepted, trees


TREE = dict(tree_budget=10, tree_topk=3, tree_depth=5)


# b) losslessness -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("verifier", ["greedy", "rejection"])
@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("arch", ["eagle3", "eagle1"])
def test_trained_head_greedy_equals_plain(target, trained, baselines, arch, shape, verifier):
    head, _ = trained[arch]
    drafter = build_drafter("eagle", target, None, 5, head=head, **(TREE if shape == "tree" else {}))
    assert drafter.hidden_layers == head.config.target_layers
    drafted, accepted, trees = run_all(Pipeline(target, drafter, verifier), baselines)
    assert 0 < accepted <= drafted
    if shape == "chain":
        assert accepted / drafted > 0.2, (accepted, drafted)  # the head learned the target, not luck
    else:
        assert trees > 0 and accepted / trees > 0.5, (accepted, trees)  # a tree drafts many nodes, accepts one path


@pytest.mark.parametrize("arch", ["eagle3", "eagle1"])
def test_untrained_head_is_still_lossless(target, baselines, arch):
    head = new_head(target.model, arch, torch.Generator().manual_seed(5))
    for options in ({}, TREE):
        run_all(Pipeline(target, build_drafter("eagle", target, None, 4, head=head, **options)), baselines)


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_seeded_sampling_equals_seeded_plain(target, trained, shape):
    head, _ = trained["eagle3"]
    pipe = Pipeline(target, build_drafter("eagle", target, None, 4, head=head, **(TREE if shape == "tree" else {})))
    options = dict(max_new_tokens=NEW_TOKENS, temperature=0.8, seed=1)
    expected = Pipeline(target, None).generate_plain(PROMPTS[2], **options).token_ids
    result = pipe.generate(PROMPTS[2], **options)
    assert result.token_ids == expected and result.stats.num_accepted_tokens > 0
    assert pipe.generate(PROMPTS[2], **{**options, "seed": 2}).token_ids != expected  # negative control


def test_unseeded_sampling_through_the_rejection_verifier(target, trained):
    """Sampled chains carry q (the verifier applies min(1, p/q)); q is zero outside the draft vocabulary."""
    head, _ = trained["eagle3"]
    drafter = build_drafter("eagle", target, None, 4, head=head)
    seen = []
    propose = drafter.propose

    def recording(*args):
        draft = propose(*args)
        seen.append(draft)
        return draft

    drafter.propose = recording
    pipe = Pipeline(target, drafter, "rejection")
    request = pipe.request(PROMPTS[0], max_new_tokens=NEW_TOKENS, temperature=0.7)
    verifier = build_verifier("rejection", request.sampling)
    decoded = speculative_decode(pipe.runner, drafter, verifier, request.prompt, request.sampling,
                                 Stopper(request.stopping, pipe.tokenizer), torch.Generator().manual_seed(0))
    assert decoded.stats.num_accepted_tokens > 0
    probs = torch.cat([d.probs for d in seen if len(d)])
    assert torch.allclose(probs.sum(-1), torch.ones(probs.shape[0]))
    assert float(probs[:, ~head.t2d].abs().max()) == 0.0


# a) training -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["eagle3", "eagle1"])
def test_training_lowers_the_loss_and_raises_held_out_agreement(target, trained, arch):
    head, report = trained[arch]
    assert len(report.losses) == 250 and report.tokens > 0
    assert sum(report.losses[-25:]) < sum(report.losses[:25])
    held_out = extract_features(target, head.config.target_layers, continuations(target, HELD_OUT))
    fresh = new_head(target.model, arch, torch.Generator().manual_seed(0),
                     draft_vocab=head.draft_to_target if arch == "eagle3" else None)
    assert evaluate(head, held_out) > evaluate(fresh, held_out) + 0.1


def test_reduced_vocabulary_maps_back_exactly(target, trained, sequences):
    head, _ = trained["eagle3"]
    ids = frequent_tokens(sequences, DRAFT_VOCAB, 320)
    assert torch.equal(head.draft_to_target, ids)  # target id = draft id + d2t[draft id]
    assert torch.equal(head.t2d.nonzero().flatten(), ids)
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    draft, full = head.draft_logits(hidden), head.logits(hidden)
    assert torch.equal(full[:, ids], draft)
    assert bool(torch.isinf(full[:, ~head.t2d]).all())
    assert torch.equal(full.argmax(-1), ids[draft.argmax(-1)])


# c) layout ---------------------------------------------------------------------------------------------------


def drafts_of(target: LoadedModel, head: EagleHead, **options) -> list[tuple[list[int], int, int]]:
    pipe = Pipeline(target, build_drafter("eagle", target, None, 4, head=head, **options))
    runs = [pipe.generate(p, max_new_tokens=20) for p in PROMPTS]
    return [(r.token_ids, r.stats.num_draft_tokens, r.stats.num_accepted_tokens) for r in runs]


def test_eagle3_head_round_trips_in_the_specforge_layout(target, trained, tmp_path):
    head, _ = trained["eagle3"]
    save_head(head, tmp_path / "head")
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] == DRAFT_VOCAB and config["vocab_size"] == 320 and config["hidden_size"] == 64
    assert config["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in head.config.target_layers]  # SGLang ids
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == config["eagle_aux_hidden_state_layer_ids"]
    assert config["sparrow_format"] == 2
    tensors = load_file(str(tmp_path / "head" / "model.safetensors"))
    assert set(tensors) == SPECFORGE_KEYS
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (64, 128)  # attention input 2d wide
    assert tensors["fc.weight"].shape == (64, 3 * 64)
    loaded = load_head(tmp_path / "head", target.model)
    assert loaded.config == head.config
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert drafts_of(target, loaded) == drafts_of(target, head)
    assert drafts_of(target, loaded, **TREE) == drafts_of(target, head, **TREE)
    # by path, as --drafter eagle --head PATH does
    by_path = build_drafter("eagle", target, None, 4, head=str(tmp_path / "head"))
    assert by_path.hidden_layers == head.config.target_layers


def test_a_preset_finds_the_head_train_head_keeps_for_it(target, trained, tmp_path, monkeypatch):
    from sparrow.heads import default_head_dir

    monkeypatch.setenv("SPARROW_CACHE", str(tmp_path))
    as_preset = LoadedModel(target.model, target.tokenizer, "smollm2-135m")  # a preset's name: a default head dir
    with pytest.raises(UserError, match="no head trained for 'smollm2-135m' yet: `sparrow train head --target "
                                        "smollm2-135m` trains one into"):
        build_drafter("eagle", as_preset, None, 4)
    with pytest.raises(UserError, match="--drafter eagle needs a head for 'tiny': --head PATH"):
        build_drafter("eagle", target, None, 4)  # not a preset: nothing to look up
    head, _ = trained["eagle3"]
    save_head(head, default_head_dir("smollm2-135m"))
    assert default_head_dir("smollm2-135m") == tmp_path / "heads" / "smollm2-135m"
    found = build_drafter("eagle", as_preset, None, 4)
    assert drafts_of(as_preset, found.head) == drafts_of(target, head)


def test_eagle1_head_round_trips(target, trained, tmp_path):
    head, _ = trained["eagle1"]
    save_head(head, tmp_path / "e1")
    tensors = load_file(str(tmp_path / "e1" / "model.safetensors"))
    assert "fc.weight" in tensors and tensors["fc.weight"].shape == (64, 128)
    assert all(k == "fc.weight" or k.startswith("layers.0.") for k in tensors)
    assert "layers.0.input_layernorm.weight" not in tensors  # EAGLE-1's layer 0 has no input norm
    loaded = load_head(tmp_path / "e1", target.model)
    assert loaded.config == head.config and loaded.config.target_layers == (2,)  # the final hidden state
    assert drafts_of(target, loaded) == drafts_of(target, head)


def write_specforge_head(directory, generator: torch.Generator, draft_ids: torch.Tensor, d: int = 64,
                         vocab: int = 320, inter: int = 96, embed: bool = True) -> None:
    """A tiny EAGLE-3 checkpoint written by hand: SpecForge's config.json keys and tensor names."""
    directory.mkdir(parents=True)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "silu", "hidden_size": d, "initializer_range": 0.02,
        "intermediate_size": inter, "max_position_embeddings": 2048, "model_type": "llama",
        "num_attention_heads": 4, "num_hidden_layers": 1, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "rope_scaling": None, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0", "use_cache": True, "vocab_size": vocab,
        "draft_vocab_size": draft_ids.numel(),
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    r = lambda *shape: (torch.randn(*shape, generator=generator) * 0.05).to(torch.bfloat16)  # noqa: E731
    one = lambda n: torch.ones(n, dtype=torch.bfloat16)  # noqa: E731
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    tensors = {
        "fc.weight": r(d, 3 * d), "midlayer.hidden_norm.weight": one(d), "midlayer.input_layernorm.weight": one(d),
        "midlayer.post_attention_layernorm.weight": one(d),
        "midlayer.self_attn.q_proj.weight": r(4 * 16, 2 * d), "midlayer.self_attn.k_proj.weight": r(2 * 16, 2 * d),
        "midlayer.self_attn.v_proj.weight": r(2 * 16, 2 * d), "midlayer.self_attn.o_proj.weight": r(d, 4 * 16),
        "midlayer.mlp.gate_proj.weight": r(inter, d), "midlayer.mlp.up_proj.weight": r(inter, d),
        "midlayer.mlp.down_proj.weight": r(d, inter), "norm.weight": one(d),
        "lm_head.weight": r(draft_ids.numel(), d) * 40, "d2t": draft_ids - torch.arange(draft_ids.numel()),
        "t2d": t2d,
    }
    if embed:  # SpecForge's training checkpoints carry the (frozen) embedding; serving ignores it
        tensors["embed_tokens.weight"] = r(vocab, d)
    save_file(tensors, str(directory / "model.safetensors"))


def test_a_specforge_checkpoint_written_by_hand_loads_and_drafts(target, baselines, tmp_path):
    generator = torch.Generator().manual_seed(3)
    draft_ids = torch.randperm(320, generator=generator)[:100].sort().values
    write_specforge_head(tmp_path / "sf", generator, draft_ids)
    head = load_head(tmp_path / "sf", target.model)
    assert head.config.arch == "eagle3" and head.config.draft_vocab_size == 100
    assert head.config.target_layers == (0, 1, 2)  # no layer ids in the config: SpecForge's default, clipped
    assert head.fc.weight.dtype == torch.float32  # the target's dtype, not the checkpoint's
    assert torch.equal(head.draft_to_target, draft_ids)
    drafter = build_drafter("eagle", target, None, 4, head=str(tmp_path / "sf"))
    proposed = []
    propose = drafter.propose
    drafter.propose = lambda *args: proposed.append(propose(*args)) or proposed[-1]
    drafted, _, _ = run_all(Pipeline(target, drafter), baselines)
    assert drafted > 0
    tokens = torch.cat([d.tokens for d in proposed])
    assert bool(torch.isin(tokens, draft_ids).all())  # drafts come from the draft vocabulary, mapped back by d2t


def test_a_head_that_does_not_fit_is_refused(target, tmp_path):
    other = tiny_model("llama", seed=1, vocab_size=400)
    save_head(new_head(other, "eagle3", torch.Generator().manual_seed(0)), tmp_path / "wide")
    with pytest.raises(UserError, match=r"vocabulary of 400 tokens but the target's has 320"):
        load_head(tmp_path / "wide", target.model)
    generator = torch.Generator().manual_seed(0)
    write_specforge_head(tmp_path / "narrow", generator, torch.arange(50), d=48)
    with pytest.raises(UserError, match=r"hidden size 48 but the target's is 64"):
        build_drafter("eagle", target, None, 4, head=str(tmp_path / "narrow"))


def test_head_errors_name_what_is_wrong(target, tmp_path):
    with pytest.raises(UserError, match="--head"):
        build_drafter("eagle", target, None, 4)
    with pytest.raises(UserError, match="config.json"):
        build_drafter("eagle", target, None, 4, head=str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}))
    save_file({"lm_head.weight": torch.zeros(3, 3)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(UserError, match="not an EAGLE-1 or EAGLE-3 head"):
        load_head(tmp_path, target.model)
    with pytest.raises(UserError, match="tree_budget"):
        build_drafter("eagle", target, None, 4, head=new_head(target.model), tree_budget=-1)


def test_cli_generate_with_drafter_eagle_and_head(target, trained, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from sparrow.cli import app

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    target.model.save_pretrained(tmp_path / "target")
    target.tokenizer.save_pretrained(tmp_path / "target")
    save_head(trained["eagle3"][0], tmp_path / "head")
    common = ["generate", PROMPTS[2], "--target", str(tmp_path / "target"), "--dtype", "float32", "--device", "cpu",
              "--max-new-tokens", "20", "--json"]
    result = CliRunner().invoke(app, [*common, "--drafter", "eagle", "--head", str(tmp_path / "head"), "--compare"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["identical"] is True and record["drafter"] == "eagle" and record["stats"]["num_accepted_tokens"] > 0
    result = CliRunner().invoke(app, [*common, "--drafter", "prompt-lookup", "--head", str(tmp_path / "head")])
    assert result.exit_code == 2 and "--head applies to --drafter eagle only" in result.output


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_a_batch_of_eagle_sequences_equals_plain(target, trained, baselines, shape):
    """The server's batched engine: each sequence forks the drafter (own head cache, shared head weights)."""
    from sparrow.decoding.batch import Batch
    from sparrow.policy.batch import BatchPolicy

    head, _ = trained["eagle3"]
    pipe = Pipeline(target, build_drafter("eagle", target, None, 4, head=head, **(TREE if shape == "tree" else {})))
    batch = Batch(target.model, BatchPolicy(adaptive=False))
    gens = [pipe.sequence(prompt, max_new_tokens=NEW_TOKENS) for prompt in PROMPTS]
    batch.add(gens[0])
    batch.step()
    batch.add(*gens[1:])  # join a running batch together: one shared prefill, each head gets its own rows
    while len(batch):
        batch.step()
    results = [pipe.result(gen) for gen in gens]
    assert [r.token_ids for r in results] == [baselines[p] for p in PROMPTS]
    assert sum(r.stats.num_accepted_tokens for r in results) > 0


# d) target layer ids: SpecForge's / SGLang's meaning (issue #28, defect A) ----------------------------------------

DEEP = 8  # target layers: SpecForge's default ids [1, L // 2 - 1, L - 4] = [1, 3, 4] -> hidden_states 2, 4, 5


@pytest.fixture(scope="module")
def deep_target() -> LoadedModel:
    return LoadedModel(tiny_model("llama", seed=2, num_layers=DEEP), tiny_tokenizer(), "tiny-deep")


def test_layer_ids_are_written_as_decoder_layer_outputs_and_read_back(deep_target, tmp_path):
    head = new_head(deep_target.model, "eagle3", torch.Generator().manual_seed(0), target_layers=(1, 4, 8))
    save_head(head, tmp_path / "h")
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 3, 7]  # output of layer i = hidden_states[i + 1]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 3, 7]
    loaded = load_head(tmp_path / "h", deep_target.model)
    assert loaded.config.target_layers == (1, 4, 8) and loaded.config == head.config


def first_draft_logits(target: LoadedModel, head_dir) -> tuple[torch.Tensor, torch.Tensor, EagleHead]:
    """The head's logits of the first draft of a generation through the engine, and the tokens of the rows it ran."""
    drafter = build_drafter("eagle", target, None, 3, head=str(head_dir))
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    forward = drafter.runner.forward

    def recording(tokens, positions=None, mask=None):
        out = forward(tokens, positions, mask)
        seen.append((tokens.clone(), out.logits.clone()))
        return out

    drafter.runner.forward = recording
    Pipeline(target, drafter).generate(PROMPTS[1], max_new_tokens=4)
    return seen[0][0], seen[0][1], drafter.head


def test_a_specforge_config_with_explicit_default_ids_reads_hidden_states_one_up(deep_target, tmp_path):
    generator = torch.Generator().manual_seed(4)
    write_specforge_head(tmp_path / "sf", generator, torch.arange(320))
    config = json.loads((tmp_path / "sf" / "config.json").read_text())
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, DEEP // 2 - 1, DEEP - 4]}  # SpecForge's default
    (tmp_path / "sf" / "config.json").write_text(json.dumps(config))
    head = load_head(tmp_path / "sf", deep_target.model)
    assert head.config.target_layers == (2, 4, 5)
    # the draft logits the engine produces are the layout's: fc over cat(hidden_states[i + 1] for the ids)
    fed, logits, head = first_draft_logits(deep_target, tmp_path / "sf")
    prompt = Pipeline(deep_target, None).encode(PROMPTS[1]).input_ids
    n = fed.numel()  # rows 0 .. n - 1 read tokens x[1 .. n] and the features of positions 0 .. n - 1
    assert torch.equal(fed, prompt[1:]) or torch.equal(fed[:-1], prompt[1:])
    sequence = torch.cat([prompt[:1], fed])
    states = deep_target.model(input_ids=sequence[None], output_hidden_states=True).hidden_states

    def by_hand(indices):
        features = torch.cat([states[i][0, :n] for i in indices], -1)
        out, _, _ = head.step(fed, head.fuse(features), torch.arange(n), causal_mask(n, 0, torch.device("cpu")), None)
        return head.logits(out[-1:])

    assert torch.allclose(logits, by_hand((2, 4, 5)), atol=1e-5)
    assert not torch.allclose(logits, by_hand((1, 3, 4)), atol=1e-3)  # the ids read as indices: another answer


def test_a_head_sparrow_saved_before_format_2_is_read_with_its_own_meaning(deep_target, tmp_path):
    head = new_head(deep_target.model, "eagle3", torch.Generator().manual_seed(0), target_layers=(2, 4, 5))
    save_head(head, tmp_path / "old")
    config = json.loads((tmp_path / "old" / "config.json").read_text())
    del config["sparrow_format"]  # format 1 wrote hidden_states indices under the same keys
    config["eagle_aux_hidden_state_layer_ids"] = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 4, 5]
    (tmp_path / "old" / "config.json").write_text(json.dumps(config))
    assert load_head(tmp_path / "old", deep_target.model).config.target_layers == (2, 4, 5)
    from sparrow.heads.layout import export_quantized

    export_quantized(tmp_path / "old", tmp_path / "old-int8")  # the export keeps the old meaning (sparrow_format 1)
    assert json.loads((tmp_path / "old-int8" / "manifest.json").read_text())["config"]["sparrow_format"] == 1
    assert load_head(tmp_path / "old-int8", deep_target.model).config.target_layers == (2, 4, 5)
    del config["bias"]  # not sparrow's key set: SpecForge's meaning
    (tmp_path / "old" / "config.json").write_text(json.dumps(config))
    assert load_head(tmp_path / "old", deep_target.model).config.target_layers == (3, 5, 6)


def test_layer_ids_beyond_the_target_are_refused_in_its_terms(target, tmp_path):
    generator = torch.Generator().manual_seed(4)
    write_specforge_head(tmp_path / "sf", generator, torch.arange(320))
    config = json.loads((tmp_path / "sf" / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [0, 1, 2]  # the target has 2 layers: ids -1 .. 1
    (tmp_path / "sf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"reads target layer ids \[0, 1, 2\] .* has 2 layers \(ids -1..1\)"):
        load_head(tmp_path / "sf", target.model)
