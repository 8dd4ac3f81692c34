"""`sparrow train head`: the offline corpus, the on-disk feature cache, resumable training, the CLI end to end.

a) The corpus is a handful of small .py/.md files written to tmp_path (never site-packages), with a decoy
   under `benchmarks/` that must never be read; the target is conftest's tiny Llama (random weights: what it
   predicts is arbitrary but deterministic, so a head can learn it).
b) Training: a few dozen steps lower the held-out loss and raise held-out agreement; resuming from a
   checkpoint gives the same weights and log as an uninterrupted run; an expired time budget still leaves a
   checkpoint.
c) The feature cache is reused (nothing recomputed) and refused when made by other layers, another target
   or another corpus; the reduced vocabulary maps back exactly; top-k labels with k = vocabulary give the
   full-distribution loss.
d) The CLI trains, resumes, and writes a head that `--drafter eagle --head` loads and decodes losslessly.
e) The CLI's head variants (a gated 2-layer EAGLE-3 head, a LongSpec head): a run stopped and resumed ends
   with the weights and log of an uninterrupted one, and the head decodes losslessly; every checkpointed variant
   (Sparrow's spec, LongSpec's window and layer) is rebuilt exactly; bad combinations fail before loading.
f) Resume reuses work: a run killed before its first checkpoint resumes with `--resume` from step 0 on the corpus
   and features it wrote (nothing extracted again) and ends as an uninterrupted run; a damaged trainer_state.pt
   is refused in one line and the previous checkpoint used; with none left, a one-line error.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import CORPUS, VOCAB, tiny_model, tiny_tokenizer
from typer.testing import CliRunner

from sparrow.drafters import build_drafter
from sparrow.errors import UserError
from sparrow.heads import load_head, save_head
from sparrow.heads.factory import new_head
from sparrow.models import LoadedModel
from sparrow.pipeline import Pipeline
from sparrow.training.data import (
    DISTILL_TASKS,
    CorpusSpec,
    build_corpus,
    distill_prompt,
    is_held_out,
    load_corpus,
    save_corpus,
)
from sparrow.training.features import SHARD_SIZE, CacheIdentity, FeatureCache, target_identity
from sparrow.training.heads import (
    Features,
    evaluate_head,
    extract_features,
    frequent_tokens,
    soft_cross_entropy,
    target_to_draft,
    train_head,
)
from sparrow.training.trainer import TrainSettings, read_log, read_state, resumed_head, run_training

pytestmark = pytest.mark.usefixtures("one_thread")

DRAFT_VOCAB = 200  # of the tiny target's 320
SNIPPETS = [*sorted(set(CORPUS)), "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n",
            "# Title\n\nSome prose about the dog and the fox.\n", "import os\nprint(os.getcwd())\n"]


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return LoadedModel(tiny_model("llama", seed=0), tiny_tokenizer(), "tiny")


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    """24 files of a few hundred bytes each, and a Spec-Bench decoy under benchmarks/."""
    root = tmp_path_factory.mktemp("corpus")
    for i in range(24):
        text = "\n".join(SNIPPETS[(i + j) % len(SNIPPETS)] for j in range(6))
        (root / f"pkg{i % 3}").mkdir(exist_ok=True)
        (root / f"pkg{i % 3}" / (f"mod{i}.py" if i % 4 else f"doc{i}.md")).write_text(text)
    (root / "benchmarks").mkdir()
    (root / "benchmarks" / "spec_bench_questions.md").write_text("SPEC-BENCH QUESTION " * 40)
    return root


def spec(corpus_dir: Path, **overrides) -> CorpusSpec:
    fields = dict(roots=(str(corpus_dir),), tokens=1200, held_out_tokens=300, sequence_length=48,
                  held_out_percent=25, distill=2, distill_tokens=24)
    return CorpusSpec(**{**fields, **overrides})


@pytest.fixture(scope="module")
def corpus(target, corpus_dir):
    return build_corpus(spec(corpus_dir), target)


@pytest.fixture(scope="module")
def features(target, corpus) -> tuple[list[Features], list[Features], torch.Tensor]:
    vocab = frequent_tokens(corpus.train, DRAFT_VOCAB, VOCAB)
    layers = new_head(target.model, "eagle3", draft_vocab=vocab).config.target_layers
    return extract_features(target, layers, corpus.train), extract_features(target, layers, corpus.held_out), vocab


def fresh_head(target, vocab):
    return new_head(target.model, "eagle3", torch.Generator().manual_seed(0), draft_vocab=vocab)


# a) corpus -----------------------------------------------------------------------------------------------------


def test_corpus_is_deterministic_split_by_file_and_skips_benchmarks(target, corpus_dir, corpus, tmp_path):
    assert corpus.train and corpus.held_out
    train_files, held_files = set(corpus.files["train"]), set(corpus.files["held_out"])
    assert train_files and held_files and not train_files & held_files
    assert all("benchmarks" not in f for f in train_files | held_files)
    for f in held_files:
        assert is_held_out(str(Path(f).relative_to(corpus_dir)), 25)
    assert sum(t.numel() for t in corpus.train) >= 1200  # files' tokens, plus self-distilled answers
    assert all(t.numel() <= 48 for t in corpus.train[:-2])  # the last two are prompt + answer
    again = build_corpus(spec(corpus_dir), target)
    assert [t.tolist() for t in again.train] == [t.tolist() for t in corpus.train]
    save_corpus(corpus, spec(corpus_dir), tmp_path)
    loaded = load_corpus(spec(corpus_dir), tmp_path)
    assert loaded is not None and [t.tolist() for t in loaded.held_out] == [t.tolist() for t in corpus.held_out]
    assert load_corpus(spec(corpus_dir, tokens=999), tmp_path) is None  # another spec: rebuilt
    with pytest.raises(UserError, match="--tokens"):
        spec(corpus_dir, tokens=0)


def test_self_distillation_asks_every_kind_of_answer_and_the_same_one_for_a_snippet():
    snippets = [f"def f{i}(x):\n    return x + {i}\n" for i in range(60)]
    prompts = [distill_prompt(s) for s in snippets]
    assert prompts == [distill_prompt(s) for s in snippets]
    assert {p.split("\n", 1)[0] for p in prompts} == set(DISTILL_TASKS)
    assert all(s.strip() in p for s, p in zip(snippets, prompts))


def test_batched_self_distillation_gives_the_sequential_answers(target):
    """transformers' batched greedy generate over left-padded prompts of different lengths (float32) gives the
    answers sparrow's own plain decoding gives one prompt at a time."""
    from sparrow.training.data import self_distilled

    snippets = SNIPPETS[:5]
    one = self_distilled(target, snippets, 12)
    batched = self_distilled(target, snippets, 12, batch_size=3)
    assert len({t.numel() for t in one}) > 1  # the prompts differ in length: padding is exercised
    assert [t.tolist() for t in batched] == [t.tolist() for t in one]


# b) training ---------------------------------------------------------------------------------------------------


def test_training_lowers_loss_and_raises_held_out_agreement(target, features):
    train, held_out, vocab = features
    head = fresh_head(target, vocab)
    before = evaluate_head(head, held_out, ttt_steps=3)
    report = train_head(head, target, [], steps=60, lr=3e-3, generator=torch.Generator().manual_seed(1),
                        ttt_steps=3, batch_size=2, features=train)
    after = evaluate_head(head, held_out, ttt_steps=3)
    assert sum(report.losses[-10:]) < sum(report.losses[:10])
    assert after.loss < before.loss - 0.5, (before, after)
    assert after.agreement[0] > before.agreement[0] + 0.15, (before, after)
    assert after.expected_accepted > before.expected_accepted


def test_resume_continues_exactly_like_an_uninterrupted_run(target, features, tmp_path):
    train, held_out, vocab = features
    settings = TrainSettings(steps=6, lr=3e-3, batch_size=2, checkpoint_every=3, eval_every=3, warmup=2)
    whole = fresh_head(target, vocab).float()
    run_training(whole, train, held_out, settings, tmp_path / "whole")

    part = fresh_head(target, vocab).float()
    first = run_training(part, train, held_out, TrainSettings(**{**settings.__dict__, "steps": 3}), tmp_path / "part")
    assert first.step == 3 and read_state(tmp_path / "part")["step"] == 3
    state = read_state(tmp_path / "part")
    resumed = resumed_head(tmp_path / "part", state, target.model, torch.device("cpu"))
    second = run_training(resumed, train, held_out, settings, tmp_path / "part", state)
    assert second.step == 6 and second.stopped == "done"
    for name, tensor in whole.state_dict().items():
        assert torch.equal(tensor, resumed.state_dict()[name]), name
    assert read_log(tmp_path / "whole" / "train_log.jsonl") == read_log(tmp_path / "part" / "train_log.jsonl")


def test_an_expired_time_budget_stops_with_a_checkpoint(target, features, tmp_path):
    import time

    train, held_out, vocab = features
    outcome = run_training(fresh_head(target, vocab).float(), train, held_out, TrainSettings(steps=50),
                           tmp_path, deadline=time.monotonic())
    assert outcome.stopped == "time budget" and outcome.step == 0
    assert read_state(tmp_path)["step"] == 0 and (tmp_path / "model.safetensors").is_file()


# c) features and vocabulary ------------------------------------------------------------------------------------


def test_feature_cache_is_reused_and_a_stale_one_refused(target, corpus, features, tmp_path):
    train, _, vocab = features
    layers = train[0].hidden.shape[1] // 64  # three layers of width 64
    assert layers == 3
    head_layers = fresh_head(target, vocab).config.target_layers
    identity = CacheIdentity(target_identity(target.model, "tiny"), head_layers, 32)
    assert FeatureCache(tmp_path, identity).extract(target.model, corpus.train) == len(corpus.train)
    cache = FeatureCache(tmp_path, identity)
    assert cache.extract(target.model, corpus.train) == 0  # all cached: nothing recomputed
    view = cache.view(len(corpus.train))
    for cached, memory in zip(view, train):
        assert torch.equal(cached.tokens, memory.tokens) and torch.equal(cached.hidden, memory.hidden)
        assert torch.equal(cached.label_ids, memory.label_ids[:, :32])
    with pytest.raises(UserError, match="layers"):
        FeatureCache(tmp_path, CacheIdentity(identity.target, (0, 1, 1), 32))
    other = target_identity(tiny_model("llama", seed=1), "tiny")
    with pytest.raises(UserError, match="made for target"):
        FeatureCache(tmp_path, CacheIdentity(other, head_layers, 32))
    with pytest.raises(UserError, match="corpus changed"):
        FeatureCache(tmp_path, identity).extract(target.model, [t.flip(0) for t in corpus.train])
    grown = [*corpus.train, *corpus.held_out]  # a larger corpus: only the new (and the refilled last) shard run
    computed = FeatureCache(tmp_path, identity).extract(target.model, grown)
    assert computed == len(corpus.held_out) + len(corpus.train) % SHARD_SIZE
    assert len(FeatureCache(tmp_path, identity).view(len(grown))) == len(grown)


def test_reduced_vocabulary_maps_back_exactly(target, corpus, tmp_path):
    ids = frequent_tokens(corpus.train, DRAFT_VOCAB, VOCAB)
    counts = torch.bincount(torch.cat(corpus.train), minlength=VOCAB)
    assert counts[ids].min() >= counts[~torch.isin(torch.arange(VOCAB), ids)].max()  # the most frequent ones
    head = fresh_head(target, ids)
    assert torch.equal(head.draft_to_target, ids)
    assert torch.equal(target_to_draft(head)[ids], torch.arange(DRAFT_VOCAB))
    assert int((target_to_draft(head) >= 0).sum()) == DRAFT_VOCAB
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    full = head.logits(hidden)
    assert torch.equal(full[:, ids], head.draft_logits(hidden)) and full.isfinite().sum() == 5 * DRAFT_VOCAB
    save_head(head, tmp_path)
    assert torch.equal(load_head(tmp_path, target.model).draft_to_target, ids)


def test_top_k_labels_with_the_whole_vocabulary_are_the_full_soft_cross_entropy(target, features):
    train, _, vocab = features
    head = fresh_head(target, vocab)
    logits = torch.randn(7, VOCAB, generator=torch.Generator().manual_seed(2))
    draft_logprobs = torch.randn(7, DRAFT_VOCAB, generator=torch.Generator().manual_seed(3)).log_softmax(-1)
    label_logprobs, labels = logits.log_softmax(-1).topk(VOCAB)
    cross, _ = soft_cross_entropy(draft_logprobs, labels, label_logprobs, target_to_draft(head))
    expected = -(logits[:, head.draft_to_target].softmax(-1) * draft_logprobs).sum(-1)
    torch.testing.assert_close(cross, expected)


# d) the CLI ----------------------------------------------------------------------------------------------------


def test_cli_trains_resumes_and_the_head_decodes_losslessly(target, corpus_dir, tmp_path, monkeypatch):
    import sparrow
    from sparrow.cli import app

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model_dir, out = tmp_path / "target", tmp_path / "run"
    target.model.save_pretrained(model_dir)
    target.tokenizer.save_pretrained(model_dir)
    common = ["train", "head", "--out", str(out), "--target", str(model_dir), "--dtype", "float32", "--device", "cpu",
              "--no-progress"]
    args = [
        *common,
        "--data",
        str(corpus_dir),
        "--tokens",
        "1200",
        "--held-out-tokens",
        "300",
        "--seq-len",
        "48",
        "--held-out-percent",
        "25",
        "--distill",
        "2",
        "--distill-tokens",
        "16",
        "--draft-vocab",
        str(DRAFT_VOCAB),
        "--steps",
        "40",
        "--batch-size",
        "2",
        "--lr",
        "3e-3",
        "--optimizer",
        "muon",
        "--checkpoint-every",
        "20",
        "--eval-every",
        "20",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert (
        report["steps"] == 40
        and report["draft_vocab_size"] == DRAFT_VOCAB
        and report["held_out"]["agreement_per_depth"]
    )
    for name in ("config.json", "model.safetensors", "trainer_state.pt", "train_log.jsonl", "training.png",
                 "eval.json", "corpus.json", "features/train/manifest.json"):
        assert (out / name).is_file(), name
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    settings = torch.load(out / "trainer_state.pt", weights_only=False)["settings"]
    assert settings["optimizer"] == "muon" and settings["init_from_target"] == "layer"  # the default where it fits
    assert report["int8"]["dir"] == str(out / "int8") and (out / "int8" / "manifest.json").is_file()  # both exports
    int8_pipe = Pipeline(target, build_drafter("eagle", target, None, 4, head=str(out / "int8")))
    assert int8_pipe.generate("def add(a, b):", max_new_tokens=12).token_ids == Pipeline(target, None).generate_plain(
        "def add(a, b):", max_new_tokens=12).token_ids

    again = CliRunner().invoke(app, args)  # a finished run is not overwritten by accident
    assert again.exit_code == 2 and "--resume" in again.output
    # --resume takes the target, dtype and cache of the run (run.json)
    resumed = CliRunner().invoke(
        app, ["train", "head", "--out", str(out), "--no-progress", "--resume", "--steps", "50"]
    )
    assert resumed.exit_code == 0, resumed.output
    report = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert report["steps"] == 50 and "feature_seconds" not in report and "corpus_seconds" not in report  # reused
    assert [r["step"] for r in read_log(out / "train_log.jsonl")] == list(range(1, 51))

    pipe = sparrow.load(str(model_dir), drafter="eagle", head=str(out), dtype="float32", device="cpu",
                        progress=False)
    plain = Pipeline(pipe.target, None)
    for prompt in ("def add(a, b):", "The quick brown fox"):
        result = pipe.generate(prompt, max_new_tokens=24)
        assert result.token_ids == plain.generate_plain(prompt, max_new_tokens=24).token_ids

    from sparrow.bench.runner import BenchConfig, Models, build_pipelines  # `sparrow bench --methods eagle --head`

    config = BenchConfig(target="tiny", draft=None, cross_draft=None, dtype="float32", k=4, adaptive=False,
                         max_new_tokens=12, turns=1, chat=False, device="cpu", head=str(out))
    pipes = build_pipelines(["plain", "eagle"], Models(pipe.target, None, None), config)
    assert pipes["eagle"].drafter.name == "eagle"
    assert pipes["eagle"].generate("def add(a, b):", max_new_tokens=12).token_ids == \
        pipes["plain"].generate("def add(a, b):", max_new_tokens=12).token_ids


@pytest.mark.parametrize("args, message", [
    (["bench", "--methods", "plain,eagle"], "--head is needed by the eagle method"),
    (["bench", "--methods", "plain,prompt-lookup", "--head", "somewhere"], "--head applies to the eagle method"),
    (["serve", "--drafter", "prompt-lookup", "--head", "somewhere"], "--head applies to --drafter eagle only"),
    (["train", "head", "--out", "x", "--arch", "eagle2"], "--arch must be one of"),
    (["train", "head", "--out", "x", "--arch", "eagle1", "--draft-vocab", "100"], "--draft-vocab applies to"),
    (["train", "head", "--out", "x", "--resume"], "holds no checkpoint"),
    (["train", "head", "--out", "x", "--arch", "sparrow"], "--arch sparrow needs a Video-LLM --target"),
    (["train", "head", "--out", "x", "--arch", "longspec", "--fusion", "gated"],
     "--fusion applies to --arch eagle3 or eagle1"),
    (["train", "head", "--out", "x", "--arch", "longspec", "--layers", "2"], "--layers applies to --arch eagle3"),
    (["train", "head", "--out", "x", "--arch", "longspec", "--draft-vocab", "100"], "--draft-vocab applies to"),
    (["train", "head", "--out", "x", "--arch", "longspec", "--anchor-offset", "-1"], "--anchor-offset must be"),
    (["train", "head", "--out", "x", "--anchor-offset", "100"], "--anchor-offset applies to --arch longspec only"),
    (["train", "head", "--out", "x", "--layers", "0"], "--layers must be an integer >= 1"),
    (["train", "head", "--out", "x", "--distill-batch", "0"], "--distill-batch must be an integer >= 1"),
    (["train", "head", "--out", "x", "--arch", "sparrow", "--distill-batch", "8"],
     "--distill-batch applies to the text corpus"),
    (["train", "head", "--out", "x", "--arch", "longspec", "--intermediate-size", "64"],
     "--intermediate-size applies to --arch eagle3"),
    (["train", "head", "--out", "x", "--fusion", "sum"], "--fusion must be one of concat, gated"),
    (["train", "head", "--out", "x", "--optimizer", "sgd"], "--optimizer must be one of adamw, muon"),
    (["train", "head", "--out", "x", "--init-from-target", "all"], "--init-from-target must be one of none, lm_head"),
    (["train", "head", "--out", "x", "--arch", "eagle1", "--init-from-target", "layer"],
     "--init-from-target layer needs an EAGLE-3 head"),
    (["train", "head", "--out", "x", "--fusion", "gated", "--init-from-target", "layer"],
     "--init-from-target layer needs an EAGLE-3 head"),
])
def test_cli_head_flags_fail_before_loading_models(args, message, tmp_path, monkeypatch):
    from sparrow.cli import app

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and message in result.output, result.output


def test_cli_time_budget_spent_during_extraction_keeps_the_cache_for_a_rerun(target, corpus_dir, tmp_path,
                                                                              monkeypatch):
    from sparrow.cli import app

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model_dir, out = tmp_path / "target", tmp_path / "run"
    target.model.save_pretrained(model_dir)
    target.tokenizer.save_pretrained(model_dir)
    args = ["train", "head", "--out", str(out), "--target", str(model_dir), "--dtype", "float32", "--no-progress",
            "--data", str(corpus_dir), "--tokens", "600", "--held-out-tokens", "100", "--seq-len", "48",
            "--held-out-percent", "25", "--distill", "0", "--steps", "3", "--batch-size", "1"]
    stopped = CliRunner().invoke(app, [*args, "--time-budget", "0.001"])
    assert stopped.exit_code == 0 and "time budget spent during feature extraction" in stopped.output
    assert not (out / "trainer_state.pt").exists()
    finished = CliRunner().invoke(app, args)  # the same command again: corpus reused, training runs
    assert finished.exit_code == 0, finished.output
    report = json.loads(finished.stdout.strip().splitlines()[-1])
    assert report["steps"] == 3 and "corpus_seconds" not in report


# e) the CLI's head variants ------------------------------------------------------------------------------------

VARIANTS = {"eagle3-gated-2": ["--arch", "eagle3", "--fusion", "gated", "--layers", "2", "--draft-vocab",
                               str(DRAFT_VOCAB), "--intermediate-size", "40", "--distill-batch", "2"],
            "longspec": ["--arch", "longspec", "--anchor-offset", "500"]}


@pytest.fixture(scope="module")
def target_dir(target, tmp_path_factory) -> Path:
    model_dir = tmp_path_factory.mktemp("target")
    target.model.save_pretrained(model_dir)
    target.tokenizer.save_pretrained(model_dir)
    return model_dir


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cli_trains_and_resumes_head_variants_that_decode_losslessly(variant, target_dir, corpus_dir, tmp_path,
                                                                     monkeypatch):
    from safetensors.torch import load_file

    from sparrow.cli import app

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def train(out: Path, steps: int) -> dict:
        args = ["train", "head", "--out", str(out), "--target", str(target_dir), "--dtype", "float32", "--device",
                "cpu", "--no-progress", "--data", str(corpus_dir), "--tokens", "600", "--held-out-tokens", "150",
                "--seq-len", "48", "--held-out-percent", "25", "--distill", "1", "--distill-tokens", "16",
                "--steps", str(steps), "--batch-size", "2", "--lr", "3e-3", "--checkpoint-every", "2",
                "--eval-every", "3", *VARIANTS[variant]]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout.strip().splitlines()[-1])

    whole, part = tmp_path / "whole", tmp_path / "part"
    train(whole, 6)
    assert train(part, 3)["steps"] == 3
    resumed = CliRunner().invoke(app, ["train", "head", "--out", str(part), "--no-progress", "--resume",
                                       "--steps", "6"])
    assert resumed.exit_code == 0, resumed.output
    report = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert report["steps"] == 6 and report["held_out"]["agreement_per_depth"]
    weights = load_file(str(whole / "model.safetensors"))
    assert weights.keys() == load_file(str(part / "model.safetensors")).keys()
    for name, tensor in load_file(str(part / "model.safetensors")).items():
        assert torch.equal(tensor, weights[name]), name
    assert read_log(whole / "train_log.jsonl") == read_log(part / "train_log.jsonl")
    config = json.loads((part / "config.json").read_text())
    if variant == "longspec":
        assert config["architectures"] == ["SparrowLongSpecHead"] and report["anchor_offset"] == 500
        assert "feature_seconds" not in report and not (part / "features").exists()  # no feature cache
    else:
        assert config["fusion"] == "gated" and config["num_hidden_layers"] == 2 and config["intermediate_size"] == 40
        assert report["fusion"] == "gated" and report["layers"] == 2 and report["draft_vocab_size"] == DRAFT_VOCAB
        assert any(k.startswith("gate.") for k in weights) and any(k.startswith("layers.1.") for k in weights)

    other = ["--fusion", "concat"] if variant != "longspec" else ["--arch", "eagle3"]
    refused = CliRunner().invoke(app, ["train", "head", "--out", str(part), "--resume", *other])
    assert refused.exit_code == 2 and "--resume continues the run's head" in refused.output, refused.output

    common = ["generate", "def add(a, b):", "--target", str(target_dir), "--dtype", "float32", "--device", "cpu",
              "--max-new-tokens", "24", "--json", "--drafter", "eagle", "--head", str(part), "--compare"]
    result = CliRunner().invoke(app, common)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["identical"] is True


def test_every_head_variant_is_rebuilt_exactly_from_its_checkpoint(target, tmp_path):
    from sparrow.training.loop import new_optimiser
    from sparrow.training.trainer import save_checkpoint

    shapes = {"gated-2": dict(arch="eagle3", fusion="gated", layers=2), "eagle1-2": dict(arch="eagle1", layers=2),
              "sparrow": dict(arch="sparrow", text_window=8, bridge_layer=1),
              "longspec": dict(arch="longspec", window=8, kv_layer=0)}
    for name, shape in shapes.items():
        head = new_head(target.model, generator=torch.Generator().manual_seed(0), **shape).float()
        settings = TrainSettings(steps=1, anchor_offset=100 if name == "longspec" else 0)
        save_checkpoint(tmp_path / name, head, new_optimiser(head, 1e-3), torch.Generator(), 0, settings)
        state = read_state(tmp_path / name)
        again = resumed_head(tmp_path / name, state, target.model, torch.device("cpu"))
        assert type(again) is type(head) and again.config == head.config, name
        assert getattr(again, "sparrow", None) == getattr(head, "sparrow", None), name
        assert TrainSettings(**state["settings"]) == settings
        for key, tensor in head.state_dict().items():
            assert torch.equal(tensor, again.state_dict()[key]), (name, key)


def test_progress_into_a_log_file_is_plain_lines_with_the_time_left(capsys):
    """stderr is no terminal here: one line per stage when it starts, at most once a minute, and when it ends."""
    from sparrow.cli.train_run import _Bars

    now = [0.0]
    with _Bars(True, log_every=60, clock=lambda: now[0]) as bars:
        assert bars.bar is None  # no rich bars (rich would draw nothing until the stage ended)
        bars.callback("features train", 0, 100)
        for t, done in ((30, 10), (61, 20), (90, 30), (200, 100)):
            now[0] = t
            bars.callback("features train", done, 100)
        bars.update("training", 5, 10, "loss 1.000")
    with _Bars(False) as quiet:
        quiet.callback("features train", 1, 2)
    assert capsys.readouterr().err.splitlines() == [
        "features train: 0/100 after 0s",
        "features train: 20/100 after 1m01s, about 4m04s left",
        "features train: 100/100 after 3m20s",
        "training: 5/10 after 0s; loss 1.000"]


def test_a_sequence_with_no_label_in_the_draft_vocabulary_trains_without_a_crash(target):
    """Issue #28 defect B: ttt_loss is a constant zero (no graph) when no row's target argmax lies in the draft
    vocabulary; train_step used to call backward on it ("element 0 of tensors does not require grad")."""
    from sparrow.training.heads import train_step
    from sparrow.training.loop import new_optimiser

    head = new_head(target.model, "eagle3", torch.Generator().manual_seed(0), draft_vocab=torch.arange(8)).float()
    f = extract_features(target, head.config.target_layers, [torch.arange(20, 60)])[0]
    outside = Features(f.tokens, f.hidden, torch.full_like(f.label_ids, 300), f.label_logprobs)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    optimiser = new_optimiser(head, 1e-3)
    result = train_step(head, optimiser, [outside, outside], ttt_steps=2)
    assert result.loss == 0.0 and result.tokens == 2 * 39
    assert all(torch.equal(before[k], v) for k, v in head.state_dict().items())  # nothing to learn: no update
    inside = Features(f.tokens, f.hidden, torch.full_like(f.label_ids, 3), f.label_logprobs)
    result = train_step(head, optimiser, [outside, inside], ttt_steps=2)  # one sequence to learn from
    assert result.loss > 0 and not torch.equal(before["fc.weight"], head.fc.weight)


# f) resume reuses work -----------------------------------------------------------------------------------------


def test_a_damaged_checkpoint_is_refused_and_the_previous_one_continues_exactly(target, features, tmp_path):
    train, held_out, vocab = features
    settings = TrainSettings(steps=6, lr=3e-3, batch_size=2, checkpoint_every=2, eval_every=3, warmup=2)
    whole = fresh_head(target, vocab).float()
    run_training(whole, train, held_out, settings, tmp_path / "whole")

    part = tmp_path / "part"
    run_training(fresh_head(target, vocab).float(), train, held_out, TrainSettings(**{**settings.__dict__,
                                                                                       "steps": 4}), part)
    assert read_state(part)["step"] == 4 and torch.load(part / "trainer_state.prev.pt")["step"] == 2
    state_file = part / "trainer_state.pt"
    state_file.write_bytes(state_file.read_bytes()[: state_file.stat().st_size // 2])  # a write cut off
    warnings: list[str] = []
    state = read_state(part, warnings.append)
    assert state["step"] == 2 and len(warnings) == 1 and "\n" not in warnings[0]
    assert "trainer_state.pt is damaged" in warnings[0] and "previous checkpoint" in warnings[0]
    resumed = resumed_head(part, state, target.model, torch.device("cpu"))  # its weights, not the layout's (step 4)
    run_training(resumed, train, held_out, settings, part, state)
    for name, tensor in whole.state_dict().items():
        assert torch.equal(tensor, resumed.state_dict()[name]), name
    assert read_log(tmp_path / "whole" / "train_log.jsonl") == read_log(part / "train_log.jsonl")

    for name in ("trainer_state.pt", "trainer_state.prev.pt"):
        (part / name).write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="damaged") as error:
        read_state(part)
    assert "\n" not in str(error.value) and "no readable checkpoint" in str(error.value)


def test_cli_resume_after_a_kill_before_the_first_checkpoint_reuses_corpus_and_features(target_dir, corpus_dir,
                                                                                       tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from sparrow.cli import app
    from sparrow.training import features as feature_cache
    from sparrow.training import trainer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = ["--target", str(target_dir), "--dtype", "float32", "--device", "cpu", "--no-progress", "--data",
            str(corpus_dir), "--tokens", "600", "--held-out-tokens", "150", "--seq-len", "48", "--held-out-percent",
            "25", "--distill", "1", "--distill-tokens", "16", "--draft-vocab", str(DRAFT_VOCAB), "--batch-size", "2",
            "--lr", "3e-3", "--checkpoint-every", "4", "--eval-every", "3"]
    whole, part = tmp_path / "whole", tmp_path / "part"
    done = CliRunner().invoke(app, ["train", "head", "--out", str(whole), *args])  # default steps: 2 epochs
    assert done.exit_code == 0, done.output
    steps = json.loads(done.stdout.strip().splitlines()[-1])["steps"]
    assert steps > 4

    real_step, taken = trainer.train_step, []

    def killed_at_step_3(*a, **k):  # Ctrl-C (or a kill) during training, before the first checkpoint (step 4)
        taken.append(1)
        if len(taken) == 3:
            raise KeyboardInterrupt
        return real_step(*a, **k)

    monkeypatch.setattr(trainer, "train_step", killed_at_step_3)
    killed = CliRunner().invoke(app, ["train", "head", "--out", str(part), *args])
    assert killed.exit_code != 0 and len(taken) == 3 and not (part / "trainer_state.pt").exists()
    assert (part / "corpus.json").is_file() and (part / "features" / "held_out" / "manifest.json").is_file()
    monkeypatch.setattr(trainer, "train_step", real_step)

    real_features_of, extracted = feature_cache.features_of, []
    monkeypatch.setattr(feature_cache, "features_of", lambda *a, **k: extracted.append(1) or real_features_of(*a, **k))
    resumed = CliRunner().invoke(app, ["train", "head", "--out", str(part), "--no-progress", "--resume"])
    assert resumed.exit_code == 0, resumed.output
    report = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert report["steps"] == steps and not extracted  # nothing extracted again, the corpus not rebuilt
    assert "feature_seconds" not in report and "corpus_seconds" not in report
    assert [r["step"] for r in read_log(part / "train_log.jsonl")] == list(range(1, steps + 1))
    weights = load_file(str(whole / "model.safetensors"))
    for name, tensor in load_file(str(part / "model.safetensors")).items():  # as if never killed
        assert torch.equal(tensor, weights[name]), name

    refused = CliRunner().invoke(app, ["train", "head", "--out", str(tmp_path / "started"), *args, "--resume"])
    assert refused.exit_code == 2 and "holds no checkpoint" in refused.output  # nothing started there

    state_file = part / "trainer_state.pt"  # damaged: the previous checkpoint continues, with a warning
    previous = torch.load(part / "trainer_state.prev.pt")["step"]
    assert previous == 4 * ((steps - 1) // 4)  # the last one every 4 steps before the end
    state_file.write_bytes(state_file.read_bytes()[:1000])
    again = CliRunner().invoke(app, ["train", "head", "--out", str(part), "--no-progress", "--resume", "--steps",
                                     str(steps + 2)])
    assert again.exit_code == 0, again.output
    assert "trainer_state.pt is damaged" in again.output and f"resuming from step {previous} " in again.output
    assert [r["step"] for r in read_log(part / "train_log.jsonl")] == list(range(1, steps + 3))
    assert json.loads(again.stdout.strip().splitlines()[-1])["steps"] == steps + 2
    for name in ("trainer_state.pt", "trainer_state.prev.pt"):
        (part / name).write_bytes(b"")
    broken = CliRunner().invoke(app, ["train", "head", "--out", str(part), "--no-progress", "--resume"])
    assert broken.exit_code == 2 and "damaged" in broken.output and "Traceback" not in broken.output


def test_cli_resume_of_a_video_run_without_a_checkpoint_says_to_rerun_its_command(tmp_path):
    from sparrow.cli import app

    (tmp_path / "run.json").write_text(json.dumps({"target": "some-vlm", "arch": "sparrow", "top_k": None}))
    result = CliRunner().invoke(app, ["train", "head", "--out", str(tmp_path), "--resume"])
    assert result.exit_code == 2 and "without --resume" in result.output and "Traceback" not in result.output
