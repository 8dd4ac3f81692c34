"""`sparrow generate`: flags -> configs -> a Pipeline -> printed results."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from sparrow.cli import flags
from sparrow.cli._common import (
    DType,
    check_float,
    check_int,
    cli_errors,
    drafter_flags_given,
    err,
)
from sparrow.drafters.plan import resolve_plan
from sparrow.drafters.registry import drafter_names
from sparrow.errors import UserError
from sparrow.request import Request, check_options


@cli_errors
def generate(
    prompt: Annotated[str, typer.Argument(help="Prompt text.")],
    target: flags.Target = "qwen2.5-coder-1.5b",
    drafter: Annotated[str, typer.Option(help=f"Drafting method: {', '.join(drafter_names())}.")] = "draft-model",
    draft: Annotated[str, typer.Option(
        help="Draft model: preset, local dir or hub id; 'default' = qwen2.5-coder-0.5b for "
        "draft-model/cross-vocab/auto, none for visual-prune (self-draft).")] = "default",
    k: flags.NumDraft = None,
    adaptive: flags.Adaptive = True,
    max_new_tokens: Annotated[int, typer.Option(help="Maximum number of new tokens.")] = 128,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_k: Annotated[int, typer.Option(help="0 = off.")] = 0,
    top_p: Annotated[float, typer.Option(help="1 = off.")] = 1.0,
    seed: Annotated[Optional[int], typer.Option(help="Seed of the sampling generator.")] = None,
    stop: Annotated[Optional[list[str]], typer.Option(help="Stop string (repeatable).")] = None,
    dtype: flags.Dtype = DType.auto,
    quant: flags.Quant = None,
    draft_quant: flags.DraftQuant = "auto",
    device: flags.Device = None,
    chat: Annotated[bool, typer.Option(help="Wrap the prompt in the tokenizer's chat template.")] = False,
    compare: Annotated[bool, typer.Option(
        help="Also run plain decoding; report identical and speedup (both paths warmed up untimed, then timed "
        "alternately in ABBA order; medians of --compare-runs runs each).")] = False,
    compare_runs: Annotated[int, typer.Option(
        help="With --compare: timed runs of each path (ABBA order; the medians are reported).")] = 2,
    as_json: Annotated[bool, typer.Option("--json", help="Print exactly one JSON object on stdout.")] = False,
    exact: Annotated[Optional[bool], typer.Option('--exact/--no-exact',
        help="Batch-invariant verification: each verify row computed exactly as plain decoding computes it, so "
        "greedy output equals plain decoding token for token in bfloat16 too (costs verify speed: attention row by "
        "row). Default: on with --quant (except a target --compile compiles), off otherwise.")] = None,
    compile_steps: Annotated[bool, typer.Option('--compile/--no-compile',
        help="Static KV cache and torch.compile'd decode/verify steps for the target and the draft model of "
        "draft-model/quantized-self/auto (text LMs without sliding-window layers; the first steps of each shape "
        "compile). An int8/int4 target compiles and stays exact (CPU); with --exact and a dense target, or --quant "
        "w8a8, only the draft model compiles; the target runs eagerly.")] = False,
    video: Annotated[Optional[str], typer.Option(
        help="Video file or directory of frames (needs a VLM target).")] = None,
    frames: Annotated[Optional[int], typer.Option(help="Frames sampled uniformly from --video (default 8).")] = None,
    image: Annotated[Optional[list[str]], typer.Option(help="Image file (repeatable; needs a VLM target).")] = None,
    verify: Annotated[str, typer.Option(
        help="Verifier: auto (lossless), greedy, rejection, or loose (LOSSY, LVSpec-style).")] = "auto",
    drop_rate: Annotated[Optional[float], typer.Option(
        help="--drafter visual-prune: share of visual tokens the draft drops (default 0.9).")] = None,
    draft_kv: Annotated[Optional[str], typer.Option(
        help="--drafter sparse, visual-prune, or draft-model with a VLM draft: draft-side visual KV policy "
        "topk|mm-shiftkv|hybridkv (target cache untouched).")] = None,
    draft_kv_budget: Annotated[Optional[int], typer.Option(
        help="With --draft-kv: visual KV entries the draft keeps per layer and KV head (default 1024).")] = None,
    retrieve_every: Annotated[Optional[int], typer.Option(
        help="With --draft-kv hybridkv: re-choose the dynamic heads' chunks every R draft rounds from the draft's "
        "current queries (default: fixed at prefill).")] = None,
    tree_budget: Annotated[str, typer.Option(
        help="Draft-tree nodes per round: an integer >= 0 or 'auto' (the drafter sizes it); 0 = a chain.")] = "0",
    tree_topk: Annotated[int, typer.Option(help="Children expanded per draft-tree node (with --tree-budget).")] = 4,
    tree_depth: Annotated[int, typer.Option(help="Maximum draft-tree depth (with --tree-budget).")] = 8,
    head: flags.Head = None,
    draft_device: Annotated[Optional[str], typer.Option(
        help="--drafter eagle: run the head on this device (e.g. cuda:0) and the target on --device; only token ids "
        "and hidden states cross (Dovetail).")] = None,
    json_schema: Annotated[
        Optional[str],
        typer.Option(
            "--json-schema",
            help="Structured output: a JSON schema file; the output is JSON that keeps to it "
            "(EOS only where complete).",
        ),
    ] = None,
    regex: Annotated[Optional[str], typer.Option(
        help="Structured output: the output matches this regular expression.")] = None,
    draft_vocab: Annotated[str, typer.Option(
        help="Drafts score only the N most frequent target tokens (FR-Spec; draft-model, quantized-self, layer-skip, "
        "auto's draft model): an integer >= 0 or 'auto' (65536 for vocabularies over 100k tokens); 0 = the full "
        "vocabulary.")] = "0",
    speculative_config: flags.SpeculativeConfig = None,
) -> None:
    """Generate text with speculative decoding."""
    import sparrow
    from sparrow.vision.video import check_media_args

    # Cheap checks first, so a typo fails before minutes of model loading: the request's options (by the one
    # validator, its messages naming the flags), then the drafter's.
    options = check_options(dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                 seed=seed, stop=tuple(stop or ()), chat=chat, video=video, frames=frames,
                                 image=image or None, **structured_options(json_schema, regex)), FLAGS)
    check_numbers(k=k, frames=frames, drop_rate=drop_rate, draft_kv_budget=draft_kv_budget)
    check_int("--compare-runs", compare_runs, 1)
    if not prompt.strip():
        raise UserError("prompt must not be empty", field="prompt")
    tree = tree_options(tree_budget, tree_topk, tree_depth)
    drafter_options = {**video_drafter_options(drop_rate, draft_kv, draft_kv_budget, retrieve_every), **tree,
                       **draft_vocab_options(draft_vocab), **head_options(head, draft_device)}
    # the plan: every drafter and format argument checked before any model loads
    plan = resolve_plan(target, drafter=drafter, draft=draft, num_draft_tokens=k, adaptive=adaptive,
                        verifier=verify, dtype=dtype.value, device=device, quant=quant, draft_quant=draft_quant,
                        compile=compile_steps, exact=exact, speculative_config=speculative_config,
                        given=drafter_flags_given(), flags=True, **drafter_options)
    check_media_args(video, frames, image)
    check_media_target(target, video, image)
    pipe = sparrow.load(plan, progress=not as_json)
    request = pipe.request(prompt, options)  # tokenized once (a video decoded once), checked against the context
    comparison = run_compare(pipe, request, compare_runs) if compare else None
    result = comparison.speculative[0] if comparison is not None else pipe.generate(request)
    ran = result.ran
    record = {
        "text": result.text, "token_ids": result.token_ids, "new_tokens": result.new_tokens,
        "finish_reason": result.finish_reason, "seconds": result.seconds,
        "tokens_per_second": result.tokens_per_second, "mean_accepted_tokens": result.stats.mean_accepted_tokens,
        "acceptance_rate": result.stats.acceptance_rate, "drafter": ran.drafter, "target": target,
        "draft": plan.draft if isinstance(plan.draft, str) else None, "dtype": ran.dtype,
        "temperature": temperature, "stats": result.stats.to_dict(), "quant": ran.quant,
        "draft_quant": ran.draft_quant,
        "compiled": ran.compiled, "draft_compiled": ran.draft_compiled, "exact": ran.exact,
        "lossless_relative_to": f"the {ran.quant}-quantized target" if ran.quant else "the target",
        "tree": tree_record(ran.tree, tree), "draft_vocab": ran.draft_vocab,
    }
    if verify == "loose":  # LOSSY: the output may differ from the target's own output
        record.update(verifier="loose", lossy=True, lossless_relative_to=None)
    if comparison is not None:
        record.update(compare_record(comparison))
    if as_json:
        sys.stdout.write(json.dumps(finite(record), allow_nan=False) + "\n")
        return
    typer.echo(result.text)
    err.print(summary(record, verify))


def check_media_target(target: str, video: str | None, images: list[str] | None) -> None:
    """--video / --image for a target its config.json says is text-only: refused before it loads (the same
    line the loaded target's processor check gives)."""
    from sparrow.models.loading import read_config

    if video is None and not images:
        return
    config = read_config(target)
    if config is not None and getattr(config, "vision_config", None) is None:
        what = "video" if video is not None else "image"
        raise UserError(f"{what}: target {target!r} is a text-only model; a vision-language model (e.g. Qwen2.5-VL, "
                        "LLaVA-OneVision) is needed for video or image input")


def run_compare(pipe: Any, request: Request, runs: int) -> Any:
    """Speculative and plain decoding of ``request``, each warmed up untimed on it (a few tokens: neither timed
    path pays for cold kernels, allocator or weight pages; with --compile, first every step size the timed runs
    take, `Pipeline.warm_up`, so no compile falls inside them), then timed ``runs`` times each in ABBA order. Each
    speculative run starts with the drafter's memory of earlier requests emptied (`forget_requests`): suffix would
    otherwise draft the repeated prompt's answer from its own earlier runs (on the 1.5B, 37 tok/s against 15 for
    the first run), a speedup no new request gets."""
    from sparrow.bench.compare import compare
    from sparrow.drafters.base import forget_requests

    stopping = request.stopping
    warm = replace(request, stopping=replace(stopping, max_new_tokens=min(8, stopping.max_new_tokens)))

    def warm_up() -> None:
        if pipe.compiled or pipe.draft_compiled:
            pipe.warm_up(request.prompt)
        pipe.generate(warm)
        pipe.generate_plain(warm)

    def speculative() -> Any:
        forget_requests(pipe.drafter)
        return pipe.generate(request)

    return compare(speculative, lambda: pipe.generate_plain(request), warm_up, runs)


def compare_record(comparison: Any) -> dict[str, Any]:
    """The JSON fields of --compare: the speculative figures become the medians of its runs; `baseline` (plain
    decoding), `identical` (every run), `speedup` (of the medians) and `compare` (order, runs, each run's tok/s)."""
    from statistics import median

    spec, plain = comparison.speculative_timing, comparison.plain_timing

    def path(timing: Any) -> dict[str, Any]:
        return {"median": timing.median, "min": timing.low, "max": timing.high, "tokens_per_second": list(timing.rates)}

    return {
        "seconds": median(r.seconds for r in comparison.speculative), "tokens_per_second": spec.median,
        "baseline": {"token_ids": comparison.plain[0].token_ids,
                     "seconds": median(r.seconds for r in comparison.plain), "tokens_per_second": plain.median},
        "identical": comparison.identical, "speedup": comparison.speedup,
        "compare": {"order": comparison.order, "runs": len(comparison.plain), "warm_up": True,
                    "speculative": path(spec), "plain": path(plain)},
    }


def structured_options(json_schema: str | None, regex: str | None) -> dict[str, Any]:
    """--json-schema FILE / --regex as the pipeline's json_schema= / regex= (the file read and parsed; the two
    checked by `check_options`, before loading)."""
    from pathlib import Path

    schema = None
    if json_schema is not None:
        path = Path(json_schema)
        if not path.is_file():
            raise UserError(f"--json-schema: no such file {json_schema!r}")
        try:
            schema = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise UserError(f"--json-schema: {json_schema!r} is not valid JSON: {e}") from None
    return {"json_schema": schema, "regex": regex}


def finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float (a rate whose timer read 0) replaced by None, so it is strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value


# sparrow's name of a request option -> its flag, for the messages of `check_options`
FLAGS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p",
         "seed": "--seed", "stop": "--stop", "json_schema": "--json-schema", "regex": "--regex", "video": "--video",
         "frames": "--frames", "image": "--image"}


def check_numbers(*, k: int | None, frames: int | None, drop_rate: float | None, draft_kv_budget: int | None) -> None:
    """Refuse the drafter's and media's out-of-range numbers, naming the flag, before any model is loaded (the
    request's own are `check_options`')."""
    check_int("-k/--num-draft-tokens", k, 1)
    check_int("--frames", frames, 1)
    check_float("--drop-rate", drop_rate, "in [0, 1)", lambda rate: 0 <= rate < 1)
    check_int("--draft-kv-budget", draft_kv_budget, 1)


def summary(record: dict[str, Any], verify: str) -> Table:
    """The human-readable table of a `generate` record (stderr, under the text)."""
    table = Table(show_header=False, box=None)
    table.add_row("drafter", f"{record['drafter']} (target {record['target']})")
    table.add_row("dtype", record["dtype"] + (f", target {record['quant']}" if record["quant"] else "")
                  + (f", draft {record['draft_quant']}" if record["draft_quant"] else ""))
    compare = record.get("compare")
    table.add_row("tokens", f"{record['new_tokens']} in {record['seconds']:.2f} s = "
                            f"{rate(record['tokens_per_second'])} tok/s"
                            + (runs(compare, "speculative") if compare else ""))
    if verify == "loose":
        table.add_row("verification", "loose (LOSSY: output may differ from the target's)")
    if record["draft_vocab"] is not None:
        table.add_row("draft vocabulary", f"the {record['draft_vocab']} most frequent tokens")
    if record["tree"] is not None:
        tree = record["tree"]
        table.add_row("draft tree", f"budget {tree['budget']}, top-k {tree['topk']}, depth {tree['depth']}")
    table.add_row("mean accepted tokens / step",
                  f"{record['mean_accepted_tokens']:.2f} (acceptance {record['acceptance_rate']:.2f})")
    if "baseline" in record:
        table.add_row("plain decoding", f"{rate(record['baseline']['tokens_per_second'])} tok/s"
                                        + (runs(compare, "plain") if compare else ""))
        table.add_row("speedup", ("-" if record["speedup"] is None else f"{record['speedup']:.2f}x")
                      + (f" (medians; {compare['order']} order after an untimed warm-up of each)" if compare else ""))
        table.add_row("identical to plain decoding", ("yes" if record["identical"] else "no")
                      + (f" (all {2 * compare['runs']} runs)" if compare else "")
                      + (f" (of the {record['quant']} target)" if record["quant"] else ""))
    return table


def rate(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.2f}"


def runs(compare: dict[str, Any], path: str) -> str:
    """' (median of N runs: min-max tok/s)' for one path of a --compare record."""
    timing = compare[path]
    count = compare["runs"]
    return f" (median of {count} run{'s' * (count != 1)}: {rate(timing['min'])}-{rate(timing['max'])})"


def tree_record(shape: tuple[int, int, int] | None, tree: dict[str, int | str]) -> dict[str, int | str] | None:
    """The JSON `tree` of a run: the shape the drafter resolved (the budget "auto" measured), else the options."""
    if not tree:
        return None
    if shape is not None:
        return dict(zip(("budget", "topk", "depth"), shape))
    return {key.removeprefix("tree_"): value for key, value in tree.items()}


def head_options(head: str | None, draft_device: str | None = None) -> dict[str, str]:
    """--head (a path) and --draft-device: the drafter options they turn into (the plan checks the drafter takes
    them)."""
    return {key: value for key, value in (("head", head), ("draft_device", draft_device)) if value is not None}


def tree_options(budget: str, topk: int, depth: int) -> dict[str, int | str]:
    """Validate --tree-budget/--tree-topk/--tree-depth; the drafter options they turn into ({} for a chain)."""
    if budget != "auto" and not (budget.isdigit() and budget.isascii()):
        raise UserError(f"--tree-budget must be an integer >= 0 or 'auto', got {budget!r}")
    if topk < 1:
        raise UserError(f"--tree-topk must be an integer >= 1, got {topk}")
    if depth < 1:
        raise UserError(f"--tree-depth must be an integer >= 1, got {depth}")
    if budget != "auto" and int(budget) == 0:
        return {}
    return {"tree_budget": budget if budget == "auto" else int(budget), "tree_topk": topk, "tree_depth": depth}


def draft_vocab_options(value: str) -> dict[str, int | str]:
    """Validate --draft-vocab; the drafter option it turns into ({} for the full vocabulary; the plan checks the
    drafter has a draft LM head)."""
    from sparrow.drafters.vocab import parse_draft_vocab

    size = parse_draft_vocab(value, "--draft-vocab")
    return {} if size is None else {"draft_vocab": size}


def video_drafter_options(drop_rate: float | None, draft_kv: str | None, draft_kv_budget: int | None,
                          retrieve_every: int | None = None) -> dict:
    """Validate --drop-rate/--draft-kv/--draft-kv-budget/--retrieve-every; the drafter options they turn into (the
    plan checks the drafter takes them). Draft-side KV policies apply to drafters keeping a visual KV of their own:
    sparse (a selection of the target's), visual-prune and draft-model (a draft VLM's own cache,
    drafters/draft_kv.py)."""
    from sparrow.drafters.kv.compress import SELECTORS
    from sparrow.drafters.visual_prune import visual_budget

    options: dict = {}
    if drop_rate is not None:
        visual_budget(1, drop_rate)
        options["drop_rate"] = drop_rate
    if draft_kv is not None or draft_kv_budget is not None or retrieve_every is not None:
        if draft_kv is not None and draft_kv not in SELECTORS:
            raise UserError(f"unknown --draft-kv {draft_kv!r}; expected one of: {', '.join(SELECTORS)}")
        if draft_kv_budget is not None and draft_kv_budget < 1:
            raise UserError(f"--draft-kv-budget must be an integer >= 1, got {draft_kv_budget}")
        options.update(draft_kv=draft_kv, draft_kv_budget=draft_kv_budget)
    if retrieve_every is not None:
        if retrieve_every < 1:
            raise UserError(f"--retrieve-every must be an integer >= 1, got {retrieve_every}")
        if draft_kv != "hybridkv":
            raise UserError("--retrieve-every (per-round chunk retrieval) needs --draft-kv hybridkv")
        options["retrieve_every"] = retrieve_every
    return options
