"""The flags `sparrow generate`, `serve` and `bench` share, declared once: `target: flags.Target = "..."` (each
command gives its own default)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from sparrow.cli._common import DTYPE_HELP, QUANT_HELP, SPECULATIVE_CONFIG_HELP, DType

Target = Annotated[str, typer.Option(help="Target model: preset, GGUF file, local dir or hub id.")]
NumDraft = Annotated[Optional[int], typer.Option(
    "-k", "--num-draft-tokens",
    help="Tokens drafted per round (at most, with --adaptive; default: the drafter's own).")]
Adaptive = Annotated[bool, typer.Option(
    "--adaptive/--fixed", help="Adapt the draft length online (confidence threshold + round cap, at most k) or draft "
    "exactly k.")]
Dtype = Annotated[DType, typer.Option(help=DTYPE_HELP)]
Quant = Annotated[Optional[str], typer.Option(help=QUANT_HELP)]
DraftQuant = Annotated[str, typer.Option(
    help="Weight format of the draft model (or of the quantized-self copy: int4 where auto picks none): auto "
    "(default): the format this machine runs a one-token draft step fastest (measured once, see `sparrow doctor`; "
    "dense where none pays); none; int8|int4|w8a8; or gguf (a draft model on its GGUF file's own blocks, CPU). "
    "Lossless either way: the target verifies.")]
Device = Annotated[Optional[str], typer.Option(help="Default: cuda if available, else cpu.")]
Head = Annotated[Optional[str], typer.Option(
    help="--drafter eagle: the head directory (EAGLE-3 layout as SpecForge exports it or `sparrow train head` "
    "writes, or EAGLE-1); default: the head shipped for a preset target, else the one `sparrow train head` trained "
    "for it.")]
SpeculativeConfig = Annotated[Optional[str], typer.Option(help=SPECULATIVE_CONFIG_HELP)]
