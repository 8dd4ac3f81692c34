"""benchmarks/llama_cpp.py without building llama.cpp or loading a model: parsing llama.cpp's timing output
(captured from real runs of the build), the cmake target listing, command assembly, and the report."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "llama_cpp.py"
spec = importlib.util.spec_from_file_location("llama_cpp_bench", PATH)
lc = importlib.util.module_from_spec(spec)
sys.path.insert(0, str(PATH.parent))  # its `common` import, as when run as a script
sys.modules["llama_cpp_bench"] = lc  # dataclasses look their module up
spec.loader.exec_module(lc)

# captured from this build (llama.cpp 0.5.0-dev, commit 0c1e570): llama-completion, qwen2.5-coder-1.5b GGUF, the
# code-prime prompt (56 tokens with the chat template), 32 new tokens, 2 threads on a loaded 2-core CPU (stderr tail)
COMPLETION_STDERR = """\
0.10.023.302 I 
1.13.118.369 I common_perf_print:    sampling time =      27.00 ms
1.13.118.411 I common_perf_print:    samplers time =      20.80 ms /    88 tokens
1.13.118.446 I common_perf_print:        load time =    8369.37 ms
1.13.118.482 I common_perf_print: prompt eval time =    8971.38 ms /    56 tokens (  160.20 ms per token,     6.24
tokens per second)
1.13.118.519 I common_perf_print:        eval time =   53995.97 ms /    31 runs   ( 1741.81 ms per token,     0.57
tokens per second)
1.13.118.609 I common_perf_print:       total time =   63102.31 ms /    87 tokens
1.13.118.645 I common_perf_print: unaccounted time =     107.97 ms /   0.2 %      (total - sampling - prompt eval -
eval) / (total)
1.13.118.679 I common_perf_print:    graphs reused =         30
"""

# captured likewise: llama-speculative-simple, 1.5B target + 0.5B draft, --spec-draft-n-max 8, -n 32 (stderr tail)
SPECULATIVE_STDERR = """\
0.07.078.223 I common_speculative_init_result: loading draft model '/root/.cache/sparrow/gguf/qwen2.5-coder-0.5b.gguf'
0.07.714.551 W load: control-looking token: 128247 '</s>' was not control-type; this is probably a bug in the model. its
type will be overridden
1.37.462.047 I encoded   56 tokens in   12.760 seconds, speed:    4.389 t/s
1.37.462.105 I decoded   41 tokens in   65.956 seconds, speed:    0.622 t/s
1.37.462.152 I 
1.37.462.193 I n_draft   = 8
1.37.462.239 I n_predict = 41
1.37.462.286 I n_drafted = 37
1.37.462.334 I n_accept  = 36
1.37.462.379 I accept    = 97.297%
1.37.462.419 I 
1.37.462.464 I draft:
1.37.462.561 I 
1.37.462.613 I target:
1.37.462.660 I common_perf_print:    sampling time =      24.90 ms
1.37.462.709 I common_perf_print:    samplers time =      17.94 ms /    41 tokens
1.37.462.756 I common_perf_print:        load time =    5219.34 ms
1.37.462.801 I common_perf_print: prompt eval time =   49111.23 ms /    99 tokens (  496.07 ms per token,     2.02
tokens per second)
1.37.462.843 I common_perf_print:        eval time =       0.00 ms /     1 runs   (    0.00 ms per token,      inf
tokens per second)
1.37.462.883 I common_perf_print:       total time =   90384.58 ms /   100 tokens
1.37.462.926 I common_perf_print: unaccounted time =   41248.45 ms /  45.6 %      (total - sampling - prompt eval -
eval) / (total)
1.37.462.970 I common_perf_print:    graphs reused =          3
"""


def test_parse_completion_counts_prompt_and_new_tokens() -> None:
    run = lc.parse_completion(COMPLETION_STDERR, stopped_at_eos=False)
    assert (run.prompt_tokens, run.new_tokens, run.decode_steps) == (56, 32, 31)  # -n 32: 31 evaluations + 1
    assert run.prompt_seconds == pytest.approx(8.97138)
    assert run.decode_seconds == pytest.approx(53.99597)
    assert run.sampling_seconds == pytest.approx(0.027)
    assert run.seconds == pytest.approx(8.97138 + 53.99597 + 0.027)
    assert run.drafted is None and run.accepted is None


def test_parse_completion_an_eos_is_no_new_token() -> None:
    """Stopped by EOS: the EOS was sampled, never evaluated nor printed, and is no new token (older llama.cpp
    printed `llama_perf_context_print`, and no sampling line here)."""
    text = ("llama_perf_context_print: prompt eval time =     100.00 ms /    20 tokens\n"
            "llama_perf_context_print:        eval time =     900.00 ms /     9 runs   (  100.00 ms per token)\n")
    run = lc.parse_completion(text, stopped_at_eos=True)
    assert (run.prompt_tokens, run.new_tokens) == (20, 9)
    assert run.seconds == pytest.approx(1.0)


def test_parse_speculative_reads_encode_decode_and_draft_counters() -> None:
    run = lc.parse_speculative(SPECULATIVE_STDERR)
    assert run.prompt_tokens == 56
    assert run.new_tokens == 41  # past -n 32: the last round accepted a whole draft
    assert run.prompt_seconds == pytest.approx(12.760)
    assert run.decode_seconds == pytest.approx(65.956)
    assert (run.drafted, run.accepted) == (37, 36)


@pytest.mark.parametrize("parse", [lambda t: lc.parse_completion(t, False), lambda t: lc.parse_speculative(t)])
def test_parse_without_timings_is_a_clear_error(parse) -> None:
    with pytest.raises(ValueError, match="no llama.cpp"):
        parse("main: error: failed to load model\n")


def test_help_targets_reads_ninja_and_make_listings() -> None:
    ninja = "[1/1] All primary targets available:\nllama-completion: phony\nllama-bench: phony\nclean: phony\n"
    make = "The following are some of the valid targets for this Makefile:\n... all\n... llama-completion\n"
    assert {"llama-completion", "llama-bench"} <= lc.help_targets(ninja)
    assert "llama-completion" in lc.help_targets(make)


def test_plain_command_passes_the_prompt_verbatim_greedy_with_threads(tmp_path: Path) -> None:
    prompt = "<|im_start|>user\nsay \\n<|im_end|>\n<|im_start|>assistant\n"
    cmd = lc.plain_command(tmp_path, Path("t.gguf"), prompt, 128, 2, 4096)
    assert cmd[0] == str(tmp_path / "llama-completion")
    assert cmd[cmd.index("-p") + 1] == prompt  # not -f: llama.cpp drops a file's trailing newline
    assert {"--no-escape", "-no-cnv", "--no-display-prompt", "--perf"} <= set(cmd)
    for flag, value in (("-m", "t.gguf"), ("-n", "128"), ("-t", "2"), ("-tb", "2"), ("--temp", "0"), ("-c", "4096")):
        assert cmd[cmd.index(flag) + 1] == value


def test_speculative_command_uses_the_draft_and_its_lengths(tmp_path: Path) -> None:
    cmd = lc.speculative_command(tmp_path, Path("t.gguf"), Path("d.gguf"), "hi", 32, 2, 2048, draft_max=8)
    assert cmd[0] == str(tmp_path / "llama-speculative-simple")
    for flag, value in (("-md", "d.gguf"), ("-td", "2"), ("-tbd", "2"), ("--spec-draft-n-max", "8"),
                        ("--spec-draft-n-min", "0"), ("-n", "32")):
        assert cmd[cmd.index(flag) + 1] == value
    assert "-no-cnv" not in cmd


def test_llama_configs_name_each_draft_length() -> None:
    assert lc.llama_configs([3, 8]) == {"llama.cpp-plain": None, "llama.cpp-spec-draft-max-3": 3,
                                        "llama.cpp-spec-draft-max-8": 8}


def test_llama_text_strips_the_echoed_prompt_and_end_marker() -> None:
    assert lc.llama_text("\n\nPROMPTdef f():\n    pass\n\n", "PROMPT", speculative=True) == "def f():\n    pass"
    assert lc.llama_text("def f(): pass [end of text]\n", "PROMPT", speculative=False) == "def f(): pass"


def test_missing_binary_says_how_to_build(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="llama.cpp not built: run python benchmarks/llama_cpp.py build"):
        lc.binary(tmp_path, "llama-completion")


META = {"target": "qwen2.5-coder-1.5b", "draft": "qwen2.5-coder-0.5b", "target_gguf": "t.gguf", "draft_gguf": "d.gguf",
        "cpu": "AMD EPYC", "cpu_flags": ["avx2", "avx512f", "avx512_bf16"], "threads": 2, "max_new_tokens": 128,
        "prompts_file": "benchmarks/prompts.json", "llama_cpp": "1 (0c1e570)", "llama_cpp_python_sdist": "0.3.36",
        "torch": "2.13.0+cpu", "sparrow_commit": "abc1234"}


def row(engine: str, config: str, kind: str, tps: float, decode: float | None = None, acceptance=None,
        match: bool = True, text: str = "same") -> dict:
    return {**META, "engine": engine, "config": config, "kind": kind, "prompt_id": f"{kind}-1", "repeat": 0,
            "tokens_per_second": tps, "decode_tokens_per_second": decode, "acceptance_rate": acceptance,
            "new_tokens": 128, "prompt_tokens_match": match, "text": text}


def test_report_means_per_kind_and_ratio_to_llama_cpp_plain() -> None:
    rows = [
        row("llama.cpp", "llama.cpp-plain", "code", 10.0, 11.0),
        row("llama.cpp", "llama.cpp-plain", "repeat", 12.0),
        row("llama.cpp", "llama.cpp-spec-draft-max-8", "code", 15.0, 16.0, 0.8),
        row("llama.cpp", "llama.cpp-spec-draft-max-8", "repeat", 18.0, 19.0, 0.6, match=False, text="other"),
        row("sparrow", "sparrow-plain-bf16", "code", 5.0),
        row("sparrow", "sparrow-plain-bf16", "repeat", 6.0),
    ]
    table = lc.render_report(rows)
    lines = table.splitlines()
    assert "AMD EPYC (avx512f, avx512_bf16), 2 threads" in lines[0] and "llama.cpp 1 (0c1e570)" in lines[0]
    assert lines[2].startswith("| engine | config | code | repeat | mean tok/s | decode tok/s | vs llama.cpp-plain |")
    plain, spec, sparrow = lines[4:7]
    assert (
        plain == "| llama.cpp | llama.cpp-plain | 10.00 | 12.00 | **11.00** | 11.00 | 1.00x | n/a | 128.0 | 2/2 | - |"
    )
    assert spec == ("| llama.cpp | llama.cpp-spec-draft-max-8 | 15.00 | 18.00 | **16.50** | 17.50 | 1.50x | 70% | "
                    "128.0 | 1/2 | 1/2 vs llama.cpp-plain |")
    assert sparrow == "| sparrow | sparrow-plain-bf16 | 5.00 | 6.00 | **5.50** | n/a | 0.50x | n/a | 128.0 | 2/2 | - |"


def test_identical_compares_token_ids_where_both_rows_have_them() -> None:
    plain = {**row("sparrow", "sparrow-plain-int4", "code", 5.0), "token_ids": [1, 2]}
    spec = {**row("sparrow", "sparrow-int4-target+draft-int4", "code", 9.0, text="differs"), "token_ids": [1, 2]}
    assert lc.identical_count([spec], [plain, spec]) == "1/1 vs sparrow-plain-int4"
    assert lc.identical_count([plain], [plain, spec]) == "-"


def test_same_output_allows_llama_cpp_speculative_to_run_past_the_limit() -> None:
    assert lc.same_output({"text": "def f():\n    return 1"}, {"text": "def f():\n"})
    assert not lc.same_output({"text": "def f():\n\n"}, {"text": "def f():\n    \n"})


def test_report_without_llama_cpp_rows_has_no_ratio() -> None:
    table = lc.render_report([row("sparrow", "sparrow-plain-bf16", "code", 5.0)])
    assert table.splitlines()[-1].split(" | ")[6] == "n/a"


def test_report_of_nothing_is_an_error() -> None:
    with pytest.raises(ValueError):
        lc.render_report([])


def test_unknown_config_is_refused() -> None:
    with pytest.raises(SystemExit, match="unknown configuration"):
        lc.check_configs(["llama.cpp-plain", "vllm"], lc.llama_configs([8]))


def test_cli_defaults_are_the_foundation_setup() -> None:
    args = lc.parse_args(["run"])
    assert (args.threads, args.max_new_tokens, args.draft_max) == (2, 128, [3, 8, 16])
    assert (args.target, args.draft, args.name) == ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "foundation")
    assert lc.parse_args(["run", "--draft-max", "4,12"]).draft_max == [4, 12]


def test_spec_bench_quick_prompts_are_the_quick_questions_first_turns():
    from common import load_prompts

    from sparrow.bench.data import DEFAULT_DATA, read_questions, shortest_per_task

    prompts = load_prompts(Path("spec-bench-quick"))
    questions = shortest_per_task(read_questions(DEFAULT_DATA))
    assert [p["prompt"] for p in prompts] == [q.turns[0] for q in questions] and len(prompts) == 6
    assert len({p["kind"] for p in prompts}) == 6 and len({p["id"] for p in prompts}) == 6
    assert load_prompts(Path("spec-bench-quick"), [prompts[2]["id"]]) == [prompts[2]]


def test_vllm_configs_name_plain_ngram_and_draft_model_per_length() -> None:
    assert lc.vllm_configs([3, 8]) == {"vllm-plain": (None, None), "vllm-spec-ngram-3": ("ngram", 3),
                                       "vllm-spec-ngram-8": ("ngram", 8), "vllm-spec-draft-3": ("draft_model", 3),
                                       "vllm-spec-draft-8": ("draft_model", 8)}
    assert lc.reference_config("vllm-spec-draft-8") == "vllm-plain"
    assert lc.reference_config("vllm-plain") is None


def test_vllm_speculative_config_per_method(tmp_path: Path) -> None:
    assert lc.vllm_speculative(None, None, tmp_path) is None
    assert lc.vllm_speculative("ngram", 8, tmp_path) == {"method": "ngram", "num_speculative_tokens": 8}
    assert lc.vllm_speculative("draft_model", 3, tmp_path) == {"method": "draft_model", "model": str(tmp_path),
                                                               "num_speculative_tokens": 3}


def test_vllm_env_binds_the_threads_sizes_the_kv_cache_and_preloads_what_exists(tmp_path: Path) -> None:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    (tmp_path / "tcmalloc.so").write_bytes(b"")
    libraries = (tmp_path / "tcmalloc.so", tmp_path / "missing.so", Path("lib") / "libiomp5.so")
    env = lc.vllm_env(tmp_path, [0, 1], {"PATH": "/bin", "LD_PRELOAD": "/x.so"}, libraries)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["LD_PRELOAD"] == f"{tmp_path}/tcmalloc.so:{tmp_path}/lib/libiomp5.so:/x.so" and env["PATH"] == "/bin"
    assert "LD_PRELOAD" not in lc.vllm_env(tmp_path / "none", [3], {}, (Path("lib") / "libiomp5.so",))


def test_vllm_row_drops_the_eos_and_reads_the_acceptance() -> None:
    out = {"id": "code-1", "token_ids": [5, 6, 7, 9], "seconds": 2.0, "ttft_seconds": 0.5, "decode_seconds": 1.0,
           "input_tokens": 20, "spec": {"num_draft_tokens": 8, "num_accepted_draft_tokens": 6,
                                        "mean_acceptance_length": 2.5}}
    r = lc.vllm_row("vllm-spec-draft-8", 8, out, {"tokens": 20}, eos={9})
    assert (r["engine"], r["new_tokens"], r["token_ids"]) == ("vllm", 3, [5, 6, 7])
    assert r["tokens_per_second"] == pytest.approx(1.5) and r["decode_tokens_per_second"] == pytest.approx(2.0)
    assert (r["drafted"], r["accepted"], r["acceptance_rate"], r["mean_accepted_tokens"]) == (8, 6, 0.75, 2.5)
    assert r["prompt_tokens_match"] and r["prefill_seconds"] == 0.5
    plain = lc.vllm_row("vllm-plain", None, {**out, "spec": None, "input_tokens": 19}, {"tokens": 20}, eos={9})
    assert plain["acceptance_rate"] is None and plain["drafted"] is None and not plain["prompt_tokens_match"]


def test_vllm_rows_only_when_its_venv_exists(tmp_path: Path, capsys) -> None:
    args = lc.parse_args(["run", "--vllm-venv", str(tmp_path), "--openvino-venv", str(tmp_path)])
    wanted = lc.wanted_configs(args)
    assert wanted["vllm"] == [] and wanted["openvino"] == [] and "no vLLM rows" in capsys.readouterr().out
    named = lc.wanted_configs(lc.parse_args(["run", "--configs", "vllm-plain,llama.cpp-plain"]))
    assert named["vllm"] == ["vllm-plain"] and named["llama.cpp"] == ["llama.cpp-plain"] and named["sparrow"] == []


def test_report_has_a_table_per_prompt_set_each_with_its_own_ratio() -> None:
    rows = [{**row("llama.cpp", "llama.cpp-plain", "code", 10.0), "set": "foundation"},
            {**row("vllm", "vllm-plain", "code", 5.0), "set": "foundation"},
            {**row("llama.cpp", "llama.cpp-plain", "humaneval", 20.0), "set": "humaneval"},
            {**row("vllm", "vllm-plain", "humaneval", 30.0), "set": "humaneval"}]
    parts = lc.render_report(rows).split("\n\n")
    assert parts[1] == "**foundation** (1 prompts)" and parts[3] == "**humaneval** (1 prompts)"
    assert "| vllm | vllm-plain | 5.00 | **5.00** | n/a | 0.50x |" in parts[2]
    assert "| vllm | vllm-plain | 30.00 | **30.00** | n/a | 1.50x |" in parts[4]
    assert "humaneval" not in parts[2]


def test_prompt_sets_tag_each_prompt_and_read_humaneval(tmp_path: Path) -> None:
    from common import load_prompt_sets

    lines = [json.dumps({"question_id": i, "category": "code", "turns": [f"Complete the code.\ndef f{i}():\n"]})
             for i in range(4)]
    (tmp_path / "humaneval.jsonl").write_text("\n".join(lines) + "\n")
    prompts = load_prompt_sets(["foundation", "humaneval"], eagle_data=tmp_path, code_questions=2)
    assert [p["id"] for p in prompts if p["set"] == "humaneval"] == ["humaneval-0", "humaneval-1"]
    assert {p["kind"] for p in prompts if p["set"] == "humaneval"} == {"humaneval"}
    assert len([p for p in prompts if p["set"] == "foundation"]) == 6
    assert prompts[-1]["prompt"] == "Complete the code.\ndef f1():\n"
    only = load_prompt_sets(["spec-bench-quick", "humaneval"], ["humaneval-1"], eagle_data=tmp_path)
    assert [p["id"] for p in only] == ["humaneval-1"]


@pytest.mark.parametrize("names,message", [(["code"], "unknown prompt set"), (["humaneval"], "no HumanEval questions")])
def test_prompt_sets_refuse_unknown_names_and_missing_data(tmp_path: Path, names, message) -> None:
    from common import load_prompt_sets

    with pytest.raises(SystemExit, match=message):
        load_prompt_sets(names, eagle_data=tmp_path)


def test_cli_set_flags() -> None:
    args = lc.parse_args(["run", "--set", "foundation,humaneval", "--code-questions", "3", "--vllm-eager"])
    assert (args.set, args.code_questions, args.vllm_eager) == ("foundation,humaneval", 3, True)
    assert lc.parse_args(["vllm-setup"]).command == "vllm-setup"
