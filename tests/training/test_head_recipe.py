"""The GPU recipe (sparrow.training.recipe) dry-run on the CPU with a tiny random target, and its carry-over pieces.

a) One run: offline files + self-distilled answers, online target features, the batched training-time test,
   held-out evaluation, the int4 export; the int4 head then decodes losslessly (float32 greedy) with drafts accepted.
b) A run killed (SIGKILL) after a checkpoint leaves a loadable int4 export and a checkpoint a --resume continues;
   the killed run is a subprocess that cannot import sparrow's other dependencies (typer, rich, gguf, av, ...),
   as on the bare device machines.
c) The batched training-time test equals the per-sequence one (sparrow.training.heads.ttt_loss) and ignores padding.
d) Chunks: a file cut into numbered chunks with SHA256SUMS joins back; a damaged or missing chunk is refused.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import CORPUS, tiny_model, tiny_tokenizer

from sparrow.drafters import build_drafter
from sparrow.errors import UserError
from sparrow.heads import load_head
from sparrow.models import LoadedModel
from sparrow.pipeline import Pipeline
from sparrow.training.chunks import SUMS, join_chunks, split_file
from sparrow.training.recipe import RecipeSettings, run

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["The quick brown fox", "def add(a, b):", "Paris is the capital of France. Paris is"]
SNIPPETS = [*sorted(set(CORPUS)), "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n",
            "import os\nprint(os.getcwd())\n"]
BLOCKED = ("typer", "rich", "gguf", "av", "accelerate", "PIL", "torchvision", "sentencepiece", "fastapi", "uvicorn",
           "matplotlib", "prometheus_client", "ray")
SMALL = {"batch_size": 8, "seq_len": 64, "distill": 16, "distill_tokens": 32, "distill_batch": 8, "draft_vocab": 200,
         "intermediate_size": 128, "ttt_steps": 3, "lr": 3e-3, "warmup": 10, "tokens": 4000,
         "held_out_tokens": 300, "threads": 1, "dtype": "float32"}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """A tiny target directory (model + tokenizer) and 40 small .py files."""
    root = tmp_path_factory.mktemp("recipe")
    model, tokenizer = tiny_model("llama", seed=0), tiny_tokenizer()
    model.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    (root / "data").mkdir()
    for i in range(40):
        (root / "data" / f"m{i}.py").write_text("\n".join(SNIPPETS[(i + j) % len(SNIPPETS)] for j in range(8)))
    return root


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return LoadedModel(tiny_model("llama", seed=0), tiny_tokenizer(), "tiny")


def decode_through(target: LoadedModel, head_dir: Path) -> int:
    """Greedy float32 decoding through the head equals plain decoding; returns the drafts accepted."""
    plain = Pipeline(target, None)
    pipe = Pipeline(target, build_drafter("eagle", target, None, 4, head=str(head_dir)))
    accepted = 0
    for prompt in PROMPTS:
        result = pipe.generate(prompt, max_new_tokens=30)
        assert result.token_ids == plain.generate_plain(prompt, max_new_tokens=30).token_ids
        accepted += result.stats.num_accepted_tokens
    return accepted


def test_a_dry_run_trains_evaluates_and_exports_an_int4_head_that_decodes_losslessly(files, target, tmp_path):
    out = tmp_path / "run"
    report = run(RecipeSettings(out=str(out), target=str(files / "target"), data=(str(files / "data"),),
                                time_budget=120, max_steps=120, checkpoint_every=1e6, **SMALL))
    assert report["stopped"] == "max steps" and report["step"] == 120 and report["error"] is None
    assert report["corpus"]["distilled"] == 16 and report["corpus"]["distilled_held_out"] == 1
    held = report["held_out"]
    assert len(held["agreement_per_depth"]) == 3 and held["agreement_per_depth"][0] > 0.3
    assert held["expected_tokens_per_round"] > 1.3
    assert json.loads((out / "eval.json").read_text())["step"] == 120
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    stages = [r["stage"] for r in rows]
    assert stages[0] == "target loaded" and stages[-1] == "done" and "corpus" in stages
    assert [r["answers"] for r in rows if r["stage"] == "distilling"] == [1, 8, 16]  # a row per generate call
    assert report["head"]["draft_vocab_size"] == 200 and report["export"]["bytes"] > 0
    config = json.loads((out / "checkpoint" / "config.json").read_text())  # the dense SpecForge layout
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["sparrow_format"] == 2
    assert load_head(out / "checkpoint", target.model).config == load_head(out / "int4", target.model).config
    assert decode_through(target, out / "int4") > 0
    with pytest.raises(UserError, match="already holds a run: pass --resume"):
        run(RecipeSettings(out=str(out), target=str(files / "target"), data=(str(files / "data"),), **SMALL))


def test_a_killed_run_resumes_from_its_checkpoint_and_runs_without_sparrows_other_dependencies(files, target,
                                                                                              tmp_path):
    out = tmp_path / "run"
    argv = ["run", "--target", str(files / "target"), "--data", str(files / "data"), "--out", str(out),
            "--time-budget", "300", "--checkpoint-every", "0.5"]
    argv += [a for k, v in SMALL.items() for a in ("--" + k.replace("_", "-"), str(v))]
    code = (f"import sys\nfor name in {BLOCKED!r}:\n    sys.modules[name] = None\n"
            "from sparrow.training.recipe import main\nsys.exit(main(sys.argv[1:]))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    process = subprocess.Popen([sys.executable, "-c", code, *argv], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    state = out / "checkpoint" / "recipe_state.pt"
    try:
        deadline = time.monotonic() + 90
        while not (state.is_file() and (out / "int4" / "manifest.json").is_file()):
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "no checkpoint within 90 s"
            time.sleep(0.2)
        time.sleep(0.3)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert not (out / "eval.json").exists()  # killed before its end
    saved = torch.load(state, weights_only=True)["progress"]["step"]
    assert saved > 0
    exported = out / "int4" if (out / "int4" / "manifest.json").is_file() else out / "int4.old"  # killed mid-swap
    assert load_head(exported, target.model).config.draft_vocab_size == 200
    report = run(RecipeSettings(out=str(out), target=str(files / "target"), resume=True, time_budget=60,
                                max_steps=saved + 5, threads=1))
    assert report["step"] == saved + 5 and report["stopped"] == "max steps"
    assert report["settings"]["draft_vocab"] == 200 and report["settings"]["seq_len"] == 64  # the run's recipe


def test_the_batched_training_time_test_equals_the_per_sequence_one(target):
    from sparrow.heads.factory import new_head
    from sparrow.training.batched import batched_ttt_loss
    from sparrow.training.heads import extract_features, ttt_loss
    from sparrow.training.recipe_data import padded, target_features

    head = new_head(target.model, "eagle3", torch.Generator().manual_seed(0), draft_vocab=torch.arange(0, 320, 2))
    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(320, (n,), generator=generator) for n in (30, 22)]
    per_sequence = extract_features(target, head.config.target_layers, sequences, top_k=8)
    for f in per_sequence:
        loss, agreement = ttt_loss(head, f, 3)
        batch = batched_ttt_loss(head, f.tokens[None], torch.tensor([f.tokens.numel()]), f.hidden[None],
                                 f.label_ids[None], f.label_logprobs[None], 3)
        assert torch.allclose(batch.loss, loss, rtol=1e-5)
        assert [a / r for a, r in zip(batch.agreed, batch.rows)] == pytest.approx(list(agreement))
    tokens, lengths = padded(sequences, 64)
    features, ids, logprobs = target_features(target.model, tokens, lengths, head.config.target_layers, 8)
    assert torch.allclose(features[1, :22], per_sequence[1].hidden, atol=1e-5)  # online = per-sequence features
    assert torch.equal(ids[1, :22], per_sequence[1].label_ids)
    first = batched_ttt_loss(head, tokens, lengths, features, ids, logprobs, 3)
    tokens[1, 22:], features[1, 22:] = 7, 5.0  # other padding: the same loss
    second = batched_ttt_loss(head, tokens, lengths, features, ids, logprobs, 3)
    assert torch.equal(first.loss, second.loss) and first.rows == (50, 48, 46) and first.positions == 50
    wide, wide_lengths = padded(sequences, 64, multiple=48)  # the training batches' shape rounding
    assert wide.shape == (2, 48) and torch.equal(wide[:, :30], padded(sequences, 64)[0])
    assert torch.equal(wide_lengths, lengths)
    third = batched_ttt_loss(head, wide, wide_lengths,
                             *target_features(target.model, wide, wide_lengths, head.config.target_layers, 8), 3)
    assert torch.allclose(third.loss, first.loss, rtol=1e-5) and third.rows == first.rows


def test_chunks_join_back_and_damage_is_refused(tmp_path):
    parts = [tmp_path / "a.bin", tmp_path / "b.bin"]
    parts[0].write_bytes(os.urandom(2500))
    parts[1].write_bytes(os.urandom(1700))
    import hashlib

    whole = hashlib.sha256(parts[0].read_bytes() + parts[1].read_bytes()).hexdigest()
    chunks = split_file(parts, "model.gguf", tmp_path / "c", chunk_bytes=1000, expected_sha256=whole)
    assert [c.name for c in chunks] == [f"model.gguf.part-0{i}" for i in range(1, 6)]
    assert [c.stat().st_size for c in chunks] == [1000, 1000, 1000, 1000, 200]
    joined = join_chunks(tmp_path / "c", tmp_path / "model.gguf")
    assert joined.read_bytes() == parts[0].read_bytes() + parts[1].read_bytes()
    joined.unlink()
    data = bytearray(chunks[2].read_bytes())
    data[0] ^= 1
    chunks[2].write_bytes(bytes(data))
    with pytest.raises(UserError, match="chunk model.gguf.part-03 .* fails its sha256 check"):
        join_chunks(tmp_path / "c", tmp_path / "model.gguf")
    chunks[2].unlink()
    with pytest.raises(UserError, match="chunk model.gguf.part-03 is missing"):
        join_chunks(tmp_path / "c")
    with pytest.raises(UserError, match="not the expected"):
        split_file(parts, "model.gguf", tmp_path / "d", chunk_bytes=1000, expected_sha256="0" * 64)
    assert (tmp_path / "c" / SUMS).read_text().splitlines()[-1] == f"{whole}  model.gguf"


def test_gguf_tensors_dequantized_in_parallel_are_handed_to_transformers_unchanged(tmp_path, monkeypatch):
    """Inside the recipe's GGUF loading the file is parsed once (gguf.GGUFReader returns that reader for it) and
    gguf.dequantize answers from the tensors dequantized beforehand on a pool, matched by file offset; any other
    file or array goes to gguf's own code."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    from sparrow.training.recipe_data import fast_gguf_loading

    rng = np.random.default_rng(0)
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    q8 = gguf.GGMLQuantizationType.Q8_0
    for i in range(3):  # equal shapes and types: only the offset tells them apart
        data = rng.standard_normal((4, 64)).astype(np.float32)
        writer.add_tensor(f"w{i}", gguf.quants.quantize(data, q8), raw_dtype=q8)
    writer.add_tensor("f", rng.standard_normal((8,)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    original, original_reader = gguf.dequantize, gguf.GGUFReader
    calls = []

    def counting(data, qtype):
        calls.append(qtype)
        return original(data, qtype)

    monkeypatch.setattr(gguf, "dequantize", counting)
    (tmp_path / "u.gguf").write_bytes(path.read_bytes())
    with fast_gguf_loading(path, 2):
        assert len(calls) == 4  # every tensor, on the pool
        from gguf import GGUFReader, dequantize  # what transformers does inside load_gguf_checkpoint

        reader = GGUFReader(str(path))
        assert reader is GGUFReader(path) and GGUFReader(tmp_path / "u.gguf") is not reader  # parsed once
        fresh = original_reader(str(tmp_path / "u.gguf"))
        for tensor, same in zip(reader.tensors, fresh.tensors):
            assert np.array_equal(dequantize(tensor.data, tensor.tensor_type), original(same.data, same.tensor_type))
        assert len(calls) == 4  # answered from the pool's results, by offset (the three Q8_0 tensors look alike)
        stray = gguf.quants.quantize(rng.standard_normal((2, 32)).astype(np.float32), q8)
        assert dequantize(stray, q8).shape == (2, 32) and len(calls) == 5
    assert gguf.dequantize is counting and gguf.GGUFReader is original_reader


def test_sigterm_ends_training_and_the_exports_still_run(files, target, tmp_path, monkeypatch):
    import signal

    from sparrow.training import recipe

    calls = []
    loss = recipe.batched_ttt_loss

    def counting(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            signal.raise_signal(signal.SIGTERM)  # as `timeout` sends it
        return loss(*args, **kwargs)

    monkeypatch.setattr(recipe, "batched_ttt_loss", counting)
    before = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "run"
    report = run(RecipeSettings(out=str(out), target=str(files / "target"), data=(str(files / "data"),),
                                time_budget=120, checkpoint_every=1e6, **{**SMALL, "distill": 2}))
    assert report["stopped"] == f"signal {int(signal.SIGTERM)}" and report["step"] == 3
    assert (out / "eval.json").is_file() and load_head(out / "int4", target.model).config.draft_vocab_size == 200
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_learning_rate_warms_up_then_decays_with_the_time_spent():
    from sparrow.training.orchestrator import lr_scale

    assert lr_scale(0, 10, 0.0) == pytest.approx(0.1) and lr_scale(9, 10, 0.0) == 1.0
    assert lr_scale(100, 10, 0.5) == pytest.approx(0.5) and lr_scale(100, 10, 1.0) == pytest.approx(0.1)


def test_bad_recipe_options_are_one_line_errors(tmp_path, capsys):
    from sparrow.training.recipe import main

    assert main(["run", "--out", str(tmp_path / "o")]) == 2
    assert "give exactly one of --target" in capsys.readouterr().err
    assert main(["run", "--out", str(tmp_path / "o"), "--target", str(tmp_path / "nowhere")]) == 2
    assert "no such directory or .gguf file" in capsys.readouterr().err
    assert main(["run", "--out", str(tmp_path / "o"), "--target", "x", "--batch-size", "0"]) == 2
    assert "--batch-size must be an integer >= 1, got 0" in capsys.readouterr().err
    assert main(["run", "--out", str(tmp_path / "o"), "--gguf-chunks", str(tmp_path), "--resume"]) == 2
    assert "holds no checkpoint" in capsys.readouterr().err
    assert main(["run", "--out", str(tmp_path / "p"), "--target", "x", "--init-head", str(tmp_path / "none")]) == 2
    assert "--init-head" in capsys.readouterr().err and not (tmp_path / "p").exists()  # before loading anything
    assert main(["run", "--out", str(tmp_path / "p"), "--target", "x", "--answers", str(tmp_path / "a.npz")]) == 2
    assert f"--answers {str(tmp_path / 'a.npz')!r}: no such file" in capsys.readouterr().err
    assert main(["run", "--out", str(tmp_path / "p"), "--target", "x", "--optimizer", "sgd"]) == 2
    assert "--optimizer must be adamw or muon, got 'sgd'" in capsys.readouterr().err
    assert main(["run", "--out", str(tmp_path / "p"), "--target", "x", "--init-from-target", "none"]) == 2
    assert "--init-from-target must be lm_head or layer, got 'none'" in capsys.readouterr().err
    assert main(["run", "--out", str(tmp_path / "p"), "--target", "x", "--dtype", "float16"]) == 2
    assert "--dtype must be auto, bfloat16 or float32, got 'float16'" in capsys.readouterr().err


def test_the_target_runs_in_bf16_on_a_gpu_and_on_cpus_with_bf16_instructions(monkeypatch):
    from sparrow.runtime.cpu import CpuInfo
    from sparrow.training import recipe_data

    def cpu(*flags: str) -> CpuInfo:
        return CpuInfo(model="test", arch="x86_64", flags=flags, logical_cpus=2, physical_cores=2)

    cuda, host = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(recipe_data, "cpu_info", lambda: cpu("avx2", "avx512f", "avx512_vnni"))
    assert recipe_data.target_dtype("auto", host) == torch.float32  # torch would emulate bf16 there
    assert recipe_data.target_dtype("auto", cuda) == torch.bfloat16
    assert recipe_data.target_dtype("bfloat16", host) == torch.bfloat16
    monkeypatch.setattr(recipe_data, "cpu_info", lambda: cpu("avx2", "avx512f", "avx512_bf16"))
    assert recipe_data.target_dtype("auto", host) == torch.bfloat16
    assert recipe_data.target_dtype("float32", host) == torch.float32


def test_muon_and_a_head_from_the_targets_last_layer_train_checkpoint_and_resume(files, target, tmp_path):
    out = tmp_path / "run"
    common = {"target": str(files / "target"), "data": (str(files / "data"),), "time_budget": 120,
              "checkpoint_every": 1e6, **{**SMALL, "distill": 0, "lr": 1e-3}}
    first = run(RecipeSettings(out=str(out), max_steps=6, optimizer="muon", init_from_target="layer", **common))
    assert first["step"] == 6 and first["error"] is None and first["settings"]["optimizer"] == "muon"
    state = torch.load(out / "checkpoint" / "recipe_state.pt", weights_only=True)
    assert len(state["optimiser"]["parts"]) == 2  # Muon's state and AdamW's
    resumed = run(RecipeSettings(out=str(out), target=str(files / "target"), resume=True, max_steps=9, threads=1))
    assert resumed["step"] == 9 and resumed["error"] is None and resumed["settings"]["init_from_target"] == "layer"


# resuming from the newest committed head, and the target's answers kept (issue #42) ------------------------------


def test_a_run_starts_from_an_int4_export_where_the_last_one_ended_on_its_kept_answers(files, target, tmp_path,
                                                                                      monkeypatch):
    """Run 1 trains a head and writes OUT/int4 and OUT/answers.npz; run 2 starts from that export (its dequantized
    weights, shape and draft vocabulary) on those answers (none generated): its first training loss is run 1's
    last, far below a fresh head's on the same first batch (both runs draw the same batches)."""
    from sparrow.training import recipe

    seen: list[tuple[float, dict | None]] = []
    loss = recipe.batched_ttt_loss

    def recording(head, *args, **kwargs):
        batch = loss(head, *args, **kwargs)
        if head.training:
            state = {k: v.detach().clone() for k, v in head.state_dict().items()} if not seen else None
            seen.append((float(batch.loss.detach()), state))
        return batch

    monkeypatch.setattr(recipe, "batched_ttt_loss", recording)
    common = {"target": str(files / "target"), "data": (str(files / "data"),), "time_budget": 120,
              "checkpoint_every": 1e6, **SMALL}
    first = run(RecipeSettings(out=str(tmp_path / "one"), max_steps=80, **common))
    fresh, last = seen[0][0], sum(s[0] for s in seen[-10:]) / 10
    export = tmp_path / "one" / "int4"
    manifest = json.loads((export / "manifest.json").read_text())
    assert "lm_head.weight" not in manifest["tensors"]  # frozen: the target's rows, left out
    assert first["init_head"] is None and first["corpus"]["distilled"] == 16
    print(f"answers.npz: {first['answers']['bytes']} bytes for {first['corpus']['distilled_tokens']} tokens")
    seen.clear()
    answers = str(tmp_path / "one" / "answers.npz")
    second = run(RecipeSettings(out=str(tmp_path / "two"), max_steps=3, init_head=str(export), answers=(answers,),
                                **{**common, "draft_vocab": 50, "distill": 0}))
    started = load_head(export, target.model).state_dict()
    assert second["init_head"] == str(export) and second["head"]["draft_vocab_size"] == 200  # the export's
    assert all(torch.equal(seen[0][1][k], v.float()) for k, v in started.items())
    resumed = seen[0][0]
    print(f"fresh head {fresh:.3f}, run 1's last 10 steps {last:.3f}, run 2's first step {resumed:.3f}")
    assert abs(resumed - last) < 0.25 * (fresh - last)  # measured: fresh 15.2, last 9.07, resumed 8.86
    rows = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert not [r for r in rows if r["stage"] == "distilling"]  # the kept answers, none generated
    assert second["corpus"]["distilled"] == 16 and second["corpus"]["distilled_held_out"] == 1
    assert second["corpus"]["answers_from"] == [answers] and second["corpus"]["distilled_new"] == 0
    assert second["held_out"]["loss"] == pytest.approx(first["held_out"]["loss"], rel=0.15)


def test_kept_answers_are_trained_on_and_only_new_prompts_are_answered(files, tmp_path):
    """A run given an earlier run's answers asks the target only prompts those did not answer, and its answers.npz
    holds both runs' answers."""
    from sparrow.training.answers import SPLITS, read_answers, tokenizer_fingerprint

    common = {"target": str(files / "target"), "data": (str(files / "data"),), "time_budget": 120, "max_steps": 1,
              "checkpoint_every": 1e6, **{**SMALL, "distill": 8}}
    run(RecipeSettings(out=str(tmp_path / "one"), **common))
    report = run(RecipeSettings(out=str(tmp_path / "two"), answers=(str(tmp_path / "one" / "answers.npz"),),
                                **common))
    fingerprint = tokenizer_fingerprint(tiny_tokenizer(), 320)
    one = read_answers(tmp_path / "one" / "answers.npz", fingerprint)
    both = read_answers(tmp_path / "two" / "answers.npz", fingerprint)
    new = report["corpus"]["distilled_new"]
    assert one.count("train") == 8 and 0 < new < 8 and both.count("train") == 8 + new  # the tiny data: few left
    assert all(torch.equal(a, b) for s in SPLITS for a, b in zip(one.sequences[s], both.sequences[s]))  # kept first
    asked = {tuple(seq[:n].tolist()) for s in SPLITS for seq, n in
             zip(both.sequences[s][one.count(s):], both.prompt_lengths[s][one.count(s):])}
    assert asked and not asked & one.prompts()  # none of the first run's prompts asked again


def test_answers_round_trip_compressed_and_foreign_or_damaged_files_are_refused(tmp_path):
    from sparrow.training.answers import Answers, read_answers, tokenizer_fingerprint, write_answers

    mine = tokenizer_fingerprint(tiny_tokenizer(), 320)
    generator = torch.Generator().manual_seed(0)
    train = tuple(torch.randint(320, (n,), generator=generator) for n in (4000, 7, 16000))
    held_out = (torch.randint(320, (12,), generator=generator),)
    answers = Answers({"train": train, "held_out": held_out}, {"train": (30, 2, 100), "held_out": (5,)})
    path = write_answers(tmp_path / "answers.npz", answers, mine)
    assert path.stat().st_size < 2 * 20019  # compressed: ~1 byte an id of 320 (uint32: 4)
    back = read_answers(path, mine)
    assert back.prompt_lengths == answers.prompt_lengths
    assert all(torch.equal(a, b) for s in answers.sequences for a, b in zip(back.sequences[s], answers.sequences[s]))
    assert [len(back.sequences[s]) for s in ("train", "held_out")] == [3, 1]
    assert back.prompts() == {tuple(train[0][:30].tolist()), tuple(train[1][:2].tolist()),
                              tuple(train[2][:100].tolist()), tuple(held_out[0][:5].tolist())}
    assert read_answers(write_answers(tmp_path / "none.npz", Answers(), mine), mine) == Answers()
    with pytest.raises(UserError, match="made with another tokenizer"):
        read_answers(path, {**mine, "tokenizer_sha256": "0" * 64})
    with pytest.raises(UserError, match="vocab_size 320, the target's is 151936"):
        read_answers(path, {**mine, "vocab_size": 151936})
    (tmp_path / "cut.npz").write_bytes(path.read_bytes()[:-40])
    with pytest.raises(UserError, match="is not a readable answers file"):
        read_answers(tmp_path / "cut.npz", mine)
    with pytest.raises(UserError, match="no such file"):
        read_answers(tmp_path / "nowhere.npz", mine)


def test_init_head_auto_picks_the_shipped_head_of_the_preset_the_gguf_names(tmp_path, monkeypatch):
    from sparrow.heads import layout
    from sparrow.training.recipe import initial_head_dir

    monkeypatch.setattr(layout, "SHIPPED", tmp_path / "shipped")
    gguf = RecipeSettings(out="o", target=str(tmp_path / "qwen2.5-coder-1.5b.gguf"))
    assert initial_head_dir(gguf) is None  # none shipped
    shipped = tmp_path / "shipped" / "qwen2.5-coder-1.5b"
    shipped.mkdir(parents=True)
    (shipped / "manifest.json").write_text("{}")
    assert initial_head_dir(gguf) == shipped
    (tmp_path / "chunks").mkdir()
    (tmp_path / "chunks" / SUMS).write_text(f"{'0' * 64}  qwen2.5-coder-1.5b.gguf.part-01\n"
                                             f"{'1' * 64}  qwen2.5-coder-1.5b.gguf\n")
    assert initial_head_dir(RecipeSettings(out="o", gguf_chunks=str(tmp_path / "chunks"))) == shipped
    assert initial_head_dir(RecipeSettings(out="o", target=str(tmp_path / "model-dir"))) is None
    assert initial_head_dir(RecipeSettings(out="o", target=str(tmp_path / "x.gguf"), init_head="none")) is None
    with pytest.raises(UserError, match="--init-head .* no such directory"):
        initial_head_dir(RecipeSettings(out="o", target="x", init_head=str(tmp_path / "nowhere")))


def test_chunks_are_sized_to_fit_a_device_call_beside_the_working_tree(tmp_path):
    from sparrow.training.chunks import chunk_bytes_beside, tree_bytes

    mib = 1 << 20
    assert chunk_bytes_beside(8 * mib) == 54 * mib  # 64 MiB - the tree - a 2 MiB margin, whole MiB
    assert chunk_bytes_beside(int(22.9 * mib)) == 39 * mib  # with a 15 MB int4 head shipped in the tree
    with pytest.raises(UserError, match="too little is left for GGUF chunks"):
        chunk_bytes_beside(55 * mib)
    assert tree_bytes(tmp_path) is None  # not a git checkout
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("ignored/\n")
    (tmp_path / "ignored").mkdir()
    (tmp_path / "ignored" / "big").write_bytes(b"x" * 5000)
    (tmp_path / "a.py").write_bytes(b"y" * 300)  # untracked, not ignored: a device call copies it too
    assert tree_bytes(tmp_path) == 300 + len("ignored/\n")


def test_a_head_whose_int4_export_would_not_fit_is_refused_before_training(files, tmp_path, monkeypatch):
    from sparrow.heads import quantized

    monkeypatch.setitem(quantized.TOTAL_BYTES, 4, 40_000)  # the tiny head: ~35 kB, its own LM head ~42 kB
    common = {"target": str(files / "target"), "data": (str(files / "data"),), "time_budget": 120, "max_steps": 1,
              **{**SMALL, "distill": 2}}
    with pytest.raises(UserError, match=r"the int4 head would take 0\.0 MB, over the 0 MB limit"):
        run(RecipeSettings(out=str(tmp_path / "big"), train_lm_head=True, **common))
    assert not (tmp_path / "big" / "checkpoint").exists()  # before any training
    assert run(RecipeSettings(out=str(tmp_path / "small"), **common))["export"]["bytes"] <= 40_000
