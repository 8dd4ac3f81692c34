"""What `sparrow bench` does: validate its flags, load the models, run, write the report.

The command's flags live in sparrow.cli.bench; heavy imports stay inside the functions.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Optional

from sparrow.bench.data import load_questions, shortest_per_task
from sparrow.bench.methods import needs_cross_draft, needs_draft, parse_methods
from sparrow.bench.report import write_report
from sparrow.bench.runner import BenchConfig, Models, Runner
from sparrow.drafters.plan import resolve_plan
from sparrow.drafters.registry import NONE, REGISTRY, takers
from sparrow.errors import UserError
from sparrow.heads.layout import find_head
from sparrow.models import load_model, resolve_device, resolve_dtype
from sparrow.models.gguf_native import load_gguf_model
from sparrow.models.gguf_source import runs_on_blocks
from sparrow.models.quantization import AUTO, GGUF, parse_quant, quantized_copy, target_format
from sparrow.runtime.hardware import choose_draft_quant

DEFAULT_METHODS = "plain,draft-model,prompt-lookup,hf-plain,hf-assisted,hf-prompt-lookup"
QUICK_METHODS = "plain,draft-model,prompt-lookup,hf-plain,hf-assisted"
QUICK_MAX_NEW_TOKENS = 64


def default_methods(quick: bool) -> str:
    methods = QUICK_METHODS if quick else DEFAULT_METHODS
    return methods + (",auto" if "auto" in REGISTRY else "")


def _list(value: Optional[str]) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def run(*, data: Path, methods: Optional[str], categories: Optional[str], limit: Optional[int],
         per_task: Optional[int], max_new_tokens: Optional[int], repeats: int, first_repeat: int, warmup: int,
         all_turns: bool, target: str, draft: str, cross_draft: str, k: Optional[int], adaptive: bool, dtype: str,
         device: Optional[str], quant: Optional[str], draft_quant: Optional[str], lookup_tokens: int, chat: bool,
         out: Path, quick: bool, progress: bool, head: Optional[str] = None,
         drafter_options: Optional[dict] = None) -> Path:
    """Validate (before any model is loaded), run and write `out`; the report's path."""
    # Cheap checks first: a typo fails before minutes of model loading.
    method_list = parse_methods(methods or default_methods(quick))
    questions = load_questions(data, _list(categories), limit, per_task)
    if quick and per_task is None and limit is None:
        questions = shortest_per_task(questions)
    if not questions:
        raise UserError("no questions selected (check --categories / --limit)")
    max_new_tokens = max_new_tokens if max_new_tokens is not None else (QUICK_MAX_NEW_TOKENS if quick else 128)
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    for name, value, low in (("repeats", repeats, 1), ("warmup", warmup, 0), ("first_repeat", first_repeat, 0),
                             ("lookup_tokens", lookup_tokens, 1)):
        if value < low:
            raise UserError(f"{name} must be >= {low}, got {value}")
    headed = [name for name in takers("head") if name in method_list]  # methods that draft with a trained head
    if head is not None and not headed:
        raise UserError(f"--head applies to the {' / '.join(takers('head'))} method only: add it to --methods")
    if headed and head is None:  # the head shipped in the package or trained for a preset target

        found = find_head(target)
        if found is None:
            raise UserError(f"--head is needed by the {headed[0]} method: no head is shipped or trained for "
                            f"{target!r} (a head directory, e.g. from `sparrow train head`)")
        head = str(found)
    compute = resolve_dtype(dtype, device)
    draft_quant = parse_quant(draft_quant, "draft_quant", auto=True)
    if draft_quant == AUTO:  # recorded as the format it resolved to (gguf: a draft whose GGUF file's blocks run)
        draft_quant = choose_draft_quant(resolve_device(device), dtype=compute, gguf=runs_on_blocks(draft))[0]
    sparrow_methods = dict.fromkeys([NONE, *(m for m in method_list if m in REGISTRY), *(drafter_options or {})])
    for name in sparrow_methods:  # each sparrow method's plan, checked as sparrow.load checks it
        options = {**(drafter_options or {}).get(name, {}), **({"head": head} if name in headed else {})}
        drafting = cross_draft if needs_cross_draft(name) else draft if needs_draft(name) else None
        plan = resolve_plan(target, drafter=name, draft=drafting, num_draft_tokens=k, adaptive=adaptive,
                            dtype=dtype, device=device, quant=quant,
                            draft_quant=draft_quant if drafting is not None else None, **options)
        if name == NONE:  # the target's format as the plan settles it ("gguf" where auto picks the file's blocks)
            settled = plan.quant
    quant = settled
    config = BenchConfig(target=target, draft=draft if any(map(needs_draft, method_list)) else None,
                         cross_draft=cross_draft if any(map(needs_cross_draft, method_list)) else None, dtype=dtype,
                         k=k, adaptive=adaptive, max_new_tokens=max_new_tokens, turns=2 if all_turns else 1,
                         chat=chat, device=str(resolve_device(device)), quant=quant, draft_quant=draft_quant,
                         lookup_tokens=lookup_tokens, head=head, drafter_options=drafter_options or {})
    models = load_models(config, progress)
    if quant == AUTO:  # recorded as the format it resolved to
        info = getattr(models.target.model, "sparrow_quantization", None)
        config = replace(config, quant=info.format if info is not None else None)
    runner = Runner(method_list, models, config)
    return run_to_dir(runner, questions, out, repeats=repeats, first_repeat=first_repeat, warmup=warmup,
                      progress=progress)


def load_models(config, progress: bool = True):
    """The target (quantized once when asked) and only the drafts some method needs."""
    def load(name: str | None):
        return load_model(name, dtype=config.dtype, device=config.device, progress=progress) if name else None

    if config.quant == GGUF:  # the target on its GGUF file's own blocks
        target = load_gguf_model(config.target, device=config.device, progress=progress)
    else:
        target = load(config.target)
        quant = target_format(target.model, config.quant)  # "auto": the format this machine verifies fastest in
        if quant is not None:
            target = quantized_copy(target, quant)
    def load_draft(name: str | None):  # a draft model on its GGUF file's blocks where --draft-quant gguf asks
        if name and config.draft_quant == GGUF:
            return load_gguf_model(name, device=config.device, progress=progress)
        return load(name)

    return Models(target, load_draft(config.draft), load_draft(config.cross_draft))


def run_to_dir(runner, questions: list, out: Path, *, repeats: int = 1, first_repeat: int = 0, warmup: int = 1,
               progress: bool = True) -> Path:
    """Run, append rows to out/rows-<run>.jsonl as they come, then write out/report.md and the plots.
    An interrupted run still gets a report of the rows it finished. Methods the models cannot run
    (runner.skipped) are named on stderr and in the report."""
    import datetime
    import json

    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )


    for method, why in runner.skipped.items():
        Console(stderr=True).print(f"skipping {method}: {why}", markup=False, highlight=False, soft_wrap=True)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = out / f"rows-{stamp}.jsonl"
    total = repeats * len(questions) * len(runner.methods)
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TimeRemainingColumn(), console=Console(stderr=True), disable=not progress, transient=False)
    rows = []
    with open(path, "a") as sink, bar:
        job = bar.add_task("warm-up", total=total)

        def on_step(method, question) -> None:
            bar.update(job, description=f"{method:>16s} q{question.question_id} ({question.task})")

        def on_row(row: dict) -> None:
            rows.append(row)
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            if "skipped" not in row:
                bar.advance(job)

        try:
            runner.run(questions, repeats=repeats, warmup=warmup, first_repeat=first_repeat, on_row=on_row,
                       on_step=on_step)
        finally:
            if rows:
                write_report(out)
    return out / "report.md"
