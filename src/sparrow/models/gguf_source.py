"""Whether a target can run on its GGUF file's own blocks (`--quant gguf`), and `--quant auto` settled to that
before any model loads.

`--quant auto` picks the format this machine measured fastest for a verification step
(`sparrow.runtime.hardware.choose_target_quant`). Most formats are quantized from the loaded dense target, so auto is
settled once it is loaded (`sparrow.models.quantization.target_format`); the GGUF file's blocks are not: a target
on them is built from the file (`sparrow.models.gguf_native.load_gguf_model`) instead of the dense model, so that
choice is made first, here, from the measurement and the file's header, and the plan then carries "gguf".
"""

from __future__ import annotations

import functools
import struct
from pathlib import Path

import torch

from sparrow.errors import UserError
from sparrow.models.gguf_native import ARCHITECTURES, read_gguf
from sparrow.models.loading import resolve_dtype
from sparrow.models.presets import PRESETS, is_installed, open_gguf
from sparrow.models.quantization import AUTO, GGUF
from sparrow.runtime import gguf_kernels
from sparrow.runtime.devices import resolve_device
from sparrow.runtime.hardware import choose_draft_quant, choose_target_quant

MIN_BLOCK_SHARE = 0.5  # the share of the layers' weight bytes that must lie in blocks the kernels take


def gguf_file(spec: object) -> bool:
    """Whether `spec` names a GGUF source: a preset (every preset ships a GGUF file) or a .gguf path. Says nothing
    of whether its blocks run (`runs_on_blocks`)."""
    return isinstance(spec, str) and (spec.strip().lower() in PRESETS or spec.strip().endswith(".gguf"))


@functools.lru_cache(maxsize=16)
def _file_runs(path: str, size: int, mtime_ns: int) -> bool:
    try:
        fields, tensors = read_gguf(Path(path))
    except (OSError, ValueError, KeyError, struct.error):
        return False  # not readable: loading it will say why
    if fields.get("general.architecture") not in ARCHITECTURES:
        return False
    layers = [t for name, t in tensors.items() if name.startswith("blk.") and len(t.shape) == 2]
    total = sum(t.data.nbytes for t in layers)
    on_blocks = sum(t.data.nbytes for t in layers if int(t.tensor_type) in gguf_kernels.BLOCKS
                    and int(t.shape[0]) % gguf_kernels.BLOCKS[int(t.tensor_type)][0] == 0)
    return total > 0 and on_blocks >= MIN_BLOCK_SHARE * total


def runs_on_blocks(spec: object) -> bool:
    """Whether `--quant gguf` runs `spec`'s layers mostly on its file's own blocks: a GGUF source (`gguf_file`) that is
    there (an installed preset, an existing file), of an architecture the native loader builds
    (`gguf_native.ARCHITECTURES`), whose layers' weights lie mostly (`MIN_BLOCK_SHARE` of their bytes) in block
    types the kernels take (Q4_K, Q6_K, Q5_0, Q8_0; not, e.g., a Q4_1 file). Reads the file's header once."""
    if not gguf_file(spec):
        return False
    name = str(spec).strip()
    try:
        if name.lower() in PRESETS:
            if not is_installed(name.lower()):
                return False
            with open_gguf(name.lower()) as path:
                stat = path.stat()
                return _file_runs(str(path), stat.st_size, stat.st_mtime_ns)
        path = Path(name).expanduser()
        stat = path.stat()
    except (OSError, UserError):
        return False
    return path.is_file() and _file_runs(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


def settle_gguf(quant: str | None, target: object, device: str | torch.device | None,
                dtype: str | torch.dtype) -> str | None:
    """`quant`, or "gguf" where it is "auto" and the measurement picks the GGUF file's own blocks for this target
    (`choose_target_quant(gguf=True)`): a GGUF source whose blocks run (`runs_on_blocks`), on a CPU, against the
    target's compute `dtype` ("auto" resolved); with `--compile` too (a GGUF target compiles and stays exact). Any
    other choice stays "auto", settled on the loaded dense target (`target_format`), which then chooses among the
    rest."""
    if quant != AUTO or not gguf_file(target) or resolve_device(device).type != "cpu":
        return quant
    fmt = choose_target_quant(device, dtype=resolve_dtype(dtype, device), gguf=True)[0]
    return GGUF if fmt == GGUF and runs_on_blocks(target) else quant


def settle_gguf_draft(draft_quant: str | None, draft: object, device: str | torch.device | None,
                      dtype: str | torch.dtype) -> str | None:
    """`draft_quant`, or "gguf" where it is "auto" and the measurement runs one draft row fastest on the draft's GGUF
    file's own blocks (`choose_draft_quant(gguf=True)`): a GGUF source whose blocks run, on a CPU. The draft's
    format never changes the output (the target verifies). Any other choice stays "auto", settled on the loaded
    dense draft (`sparrow.models.quantization.draft_format`)."""
    if draft_quant != AUTO or not gguf_file(draft) or resolve_device(device).type != "cpu":
        return draft_quant
    fmt = choose_draft_quant(device, dtype=resolve_dtype(dtype, device), gguf=True)[0]
    return GGUF if fmt == GGUF and runs_on_blocks(draft) else draft_quant


__all__ = ["gguf_file", "runs_on_blocks", "settle_gguf", "settle_gguf_draft"]
