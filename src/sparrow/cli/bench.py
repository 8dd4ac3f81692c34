"""`sparrow bench`: the Spec-Bench speed benchmark from the command line (the work: sparrow.bench.command)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from sparrow.bench.command import DEFAULT_METHODS, QUICK_MAX_NEW_TOKENS, QUICK_METHODS, run
from sparrow.bench.data import DEFAULT_DATA
from sparrow.cli import flags
from sparrow.cli._common import (
    QUANT_HELP,
    SPECULATIVE_CONFIG_HELP,
    DType,
    check_int,
    cli_errors,
    drafter_flags_given,
    dtype_name,
)
from sparrow.drafters.plan import resolve_plan


@cli_errors
def bench(
    data: Annotated[Path, typer.Option(
        help="Spec-Bench question.jsonl (question_id, category, turns).")] = DEFAULT_DATA,
    methods: Annotated[
        Optional[str],
        typer.Option(
            "--methods",
            "--drafter",
            help="Comma-separated: plain or any drafter (sparrow), hf-plain, hf-assisted, hf-prompt-lookup, hf-uad "
                "(transformers). Baselines are added. Default: "
            + DEFAULT_METHODS
            + " "
            "(+auto when registered).",
        ),
    ] = None,
    categories: Annotated[Optional[str], typer.Option(
        help="Comma-separated categories or tasks (mt_bench, translation, summarization, qa, math_reasoning, rag). "
        "Default: all.")] = None,
    limit: Annotated[Optional[int], typer.Option(help="At most N questions per category.")] = None,
    per_task: Annotated[Optional[int], typer.Option(help="At most N questions per task.")] = None,
    max_new_tokens: Annotated[
        Optional[int], typer.Option(help=f"New tokens per turn (default 128; {QUICK_MAX_NEW_TOKENS} with --quick).")
    ] = None,
    repeats: Annotated[int, typer.Option(help="Timed repeats (mean ± std).")] = 1,
    first_repeat: Annotated[int, typer.Option(
        help="Index of the first repeat (to add repeats to an earlier run's directory).")] = 0,
    warmup: Annotated[int, typer.Option(help="Warm-up runs of every method on the first question.")] = 1,
    all_turns: Annotated[bool, typer.Option('--all-turns/--first-turn',
        help="Generate every turn of multi-turn questions (Spec-Bench) or only the first.")] = False,
    target: flags.Target = "qwen2.5-coder-1.5b",
    draft: Annotated[str, typer.Option(
        help="Draft model with the target's vocabulary (draft-model, hf-assisted).")] = "qwen2.5-coder-0.5b",
    cross_draft: Annotated[str, typer.Option(
        help="Draft model with another tokenizer (cross-vocab, hf-uad).")] = "smollm2-135m",
    k: flags.NumDraft = None,
    adaptive: flags.Adaptive = True,
    dtype: flags.Dtype = DType.auto,
    device: flags.Device = None,
    quant: Annotated[Optional[str], typer.Option(help=QUANT_HELP + " The target of every method.")] = None,
    draft_quant: Annotated[
        Optional[str],
        typer.Option(
            help="int8|int4|w8a8|gguf draft model for sparrow's drafters, or "
            "auto (the format this machine runs a one-token draft step "
            "fastest; recorded resolved). Default: dense, so every method "
            "drafts with the same weights."
        ),
    ] = None,
    head: Annotated[Optional[str], typer.Option(
        help="The eagle method's head directory (EAGLE-3 layout, e.g. from `sparrow train head`).")] = None,
    lookup_tokens: Annotated[int, typer.Option(
        help="transformers' prompt_lookup_num_tokens for hf-prompt-lookup.")] = 10,
    chat: Annotated[bool, typer.Option('--chat/--no-chat',
        help="Wrap questions in the target's chat template.")] = True,
    out: Annotated[Path, typer.Option(help="Output directory: rows-<run>.jsonl, report.md, *.png.")] = Path(
        "sparrow-bench"
    ),
    report_only: Annotated[Optional[Path], typer.Option(
        help="Only render DIR's report from its JSONL files (combines runs).")] = None,
    quick: Annotated[
        bool,
        typer.Option(
            help=f"Smoke run: the shortest question of each task, {QUICK_MAX_NEW_TOKENS} "
            f"new tokens, methods {QUICK_METHODS}."
        ),
    ] = False,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Rich progress bar on stderr.")] = True,
    speculative_config: Annotated[
        Optional[str],
        typer.Option(help=SPECULATIVE_CONFIG_HELP + " Its method joins --methods; its options apply to that method."),
    ] = None,
) -> None:
    """Spec-Bench speed benchmark: sparrow's drafters and transformers' peers, same prompts, same process."""
    if report_only is not None:
        from sparrow.bench.report import write_report

        typer.echo(write_report(report_only).read_text())
        return
    for flag, value, low in (
        ("--limit", limit, 1),
        ("--per-task", per_task, 1),
        ("--max-new-tokens", max_new_tokens, 1),
        ("--repeats", repeats, 1),
        ("--first-repeat", first_repeat, 0),
        ("--warmup", warmup, 0),
        ("-k/--num-draft-tokens", k, 1),
        ("--lookup-tokens", lookup_tokens, 1),
    ):
        check_int(flag, value, low)  # before any model is loaded
    drafter_options: dict[str, dict] = {}
    if speculative_config is not None:
        from sparrow.bench.command import default_methods

        plan = resolve_plan(target, draft=draft, num_draft_tokens=k, dtype=dtype.value, device=device,
                            speculative_config=speculative_config, given=drafter_flags_given(), flags=True,
                            **({"head": head} if head is not None else {}))  # the config's method and options
        method, k, options = plan.drafter, plan.num_draft_tokens, plan.drafter_options
        draft = plan.draft if isinstance(plan.draft, str) else draft
        head = options.pop("head", None)
        listed = [m.strip() for m in (methods or default_methods(quick)).split(",") if m.strip()]
        methods = ",".join(listed if method in listed else [*listed, method])
        drafter_options = {method: options} if options else {}
    report = run(data=data, methods=methods, categories=categories, limit=limit, per_task=per_task,
                 max_new_tokens=max_new_tokens, repeats=repeats, first_repeat=first_repeat, warmup=warmup,
                 all_turns=all_turns, target=target, draft=draft, cross_draft=cross_draft, k=k, adaptive=adaptive,
                 dtype=dtype_name(dtype, device), device=device, quant=quant, draft_quant=draft_quant,
                 lookup_tokens=lookup_tokens, chat=chat, out=out, quick=quick, progress=progress, head=head,
                 drafter_options=drafter_options)
    typer.echo(report.read_text())
