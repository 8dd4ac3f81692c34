"""Kernels that multiply by weights kept in GGUF's own block bytes (Q8_0, Q5_0, Q4_K, Q6_K): torch custom ops in C++.

``gguf_kernels.cpp`` (shipped as package data) is compiled once on first use with ``torch.utils.cpp_extension.load``
into ``<sparrow cache>/kernels/gguf-<key>/``, the key hashing the source, torch's version, the compiler and the
CPU's SIMD flags, so a new torch, source or machine builds afresh and every later process only loads the library.
Without a compiler, or if the build fails, `available()` is False after one line on stderr, and callers keep to the
existing (dequantized) paths.

The ops (``torch.ops.sparrow_gguf``; see the C++ file's header for the numerics):

* ``matmul(x, blocks, type, out_features, int8)``: ``x [M, K] @ W^T`` with ``W`` given by its blocks; ``int8``:
  activations quantized to 8 bits per row (llama.cpp's numerics, integer dot products: AVX2, or AVX-512 VNNI with
  the same bits where the CPU has it), else float activations
  times the dequantized weight. Batch-invariant by construction: row ``m`` of the output is the same bits
  whatever the other rows are.
* ``dequantize(blocks, type, in_features)``: the float32 weight, bit for bit the ``gguf`` package's
  ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import warnings
from pathlib import Path

import torch
from torch import Tensor

from sparrow.errors import UserError
from sparrow.paths import default_cache_dir
from sparrow.runtime.cpu import cpu_info

SOURCE = Path(__file__).with_name("gguf_kernels.cpp")
OFF = {"0", "false", "no", "off"}
# -fopenmp: at::parallel_for is inlined from ATen's OpenMP header, so without it the threads never split the output
# rows (the kernels ran on one thread whatever torch.set_num_threads said)
CFLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
ENV = "SPARROW_GGUF_KERNELS"  # "0" / "off": never build or load the kernels

# GGML type id -> (weights per block, bytes per block); the formats the kernels take
Q5_0, Q8_0, Q4_K, Q6_K = 6, 8, 12, 14
# not GGML ids: Q4_K / Q6_K weights in sparrow's packed layouts (`pack`: 16 rows interleaved, 148 / 210 bytes a row
# and 256 values)
Q4_KX16, Q6_KX16, PACK_ROWS = 1012, 1014, 16
PACKED = {Q4_K: Q4_KX16, Q6_K: Q6_KX16}  # file type -> the packed layout's type
BLOCKS: dict[int, tuple[int, int]] = {Q5_0: (32, 22), Q8_0: (32, 34), Q4_K: (256, 144), Q6_K: (256, 210),
                                      Q4_KX16: (256, 148), Q6_KX16: (256, 210)}
TYPE_NAMES = {Q5_0: "Q5_0", Q8_0: "Q8_0", Q4_K: "Q4_K", Q6_K: "Q6_K", Q4_KX16: "Q4_K packed",
              Q6_KX16: "Q6_K packed"}
SCALE_OFFSETS = {Q5_0: (0,), Q8_0: (0,), Q4_K: (0, 2), Q6_K: (208,)}  # where each block's fp16 scales lie
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16",
             "amx_tile", "amx_int8", "asimd", "asimddp", "i8mm")  # flags a kernel may be built or chosen for

_STATE: dict[str, object] = {}


def build_key() -> str:
    """What a built library depends on: the source, torch, the compiler and the CPU's SIMD features."""
    flags = sorted(set(ISA_FLAGS) & set(cpu_info().flags))
    compiler = os.environ.get("CXX", "c++")
    parts = [SOURCE.read_bytes(), torch.__version__.encode(), platform.machine().encode(), compiler.encode(),
             " ".join(flags).encode(), " ".join(CFLAGS + LDFLAGS).encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def build_dir() -> Path:
    return default_cache_dir() / "kernels" / f"gguf-{build_key()}"


def _notice(message: str) -> None:
    print(f"sparrow: {message}", file=sys.stderr, flush=True)


def _register_fakes() -> None:
    """Shapes for torch.compile / meta tensors."""

    @torch.library.register_fake("sparrow_gguf::matmul")
    def _(x: Tensor, blocks: Tensor, type: int, out_features: int, int8: bool, bias: Tensor | None = None) -> Tensor:
        return x.new_empty(x.shape[0], out_features)

    @torch.library.register_fake("sparrow_gguf::pack")
    def _(blocks: Tensor, type: int, out_features: int, in_features: int) -> Tensor:
        return blocks.new_empty(out_features // PACK_ROWS, in_features // 256 * BLOCKS[PACKED[type]][1] * PACK_ROWS)

    @torch.library.register_fake("sparrow_gguf::dequantize")
    def _(blocks: Tensor, type: int, in_features: int) -> Tensor:
        values, nbytes = BLOCKS[type]
        return blocks.new_empty(blocks.numel() // (in_features // values * nbytes), in_features, dtype=torch.float32)


def _build() -> None:
    logger = logging.getLogger("torch.utils.cpp_extension")  # its import warns that there is no CUDA: not needed
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension  # lazily: it imports setuptools, needed only to build
    finally:
        logger.setLevel(level)

    if shutil.which(os.environ.get("CXX", "c++")) is None:
        raise RuntimeError("no C++ compiler (c++) on PATH")
    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cpp_extension.load(name="sparrow_gguf_kernels", sources=[str(SOURCE)], build_directory=str(directory),
                           extra_cflags=CFLAGS, extra_ldflags=LDFLAGS, is_python_module=False, verbose=False)


def available() -> bool:
    """Whether the ops are loaded (built first if needed); False, after one line on stderr, where they cannot be."""
    if "ok" not in _STATE:
        ok = False
        if os.environ.get(ENV, "").strip().lower() in OFF:
            _STATE["why"] = f"{ENV}={os.environ[ENV]}"
        elif hasattr(torch.ops.sparrow_gguf, "matmul"):  # loaded by someone else in this process
            ok = True
        else:
            try:
                _build()
                _register_fakes()
                ok = True
            except Exception as exc:  # no compiler, no headers, a compile error: the existing paths still work
                why = " ".join(str(exc).split())[:200] or type(exc).__name__
                _STATE["why"] = why
                _notice(f"GGUF kernels unavailable ({why}); using the existing kernels")
        _STATE["ok"] = ok
    return bool(_STATE["ok"])


def why_unavailable() -> str:
    return str(_STATE.get("why", ""))


def _ops() -> object:
    if not available():
        raise UserError(f"the GGUF kernels could not be built here ({why_unavailable()})")
    return torch.ops.sparrow_gguf


def row_bytes(qtype: int, in_features: int) -> int:
    """Bytes one output row of a [*, in_features] weight of GGML type `qtype` takes; UserError for a type the kernels
    do not take or an in_features that is not a whole number of its blocks."""
    if qtype not in BLOCKS:
        raise UserError(f"GGML type {qtype} has no GGUF kernel (supported: "
                        f"{', '.join(f'{n} ({t})' for t, n in TYPE_NAMES.items())})")
    values, nbytes = BLOCKS[qtype]
    if in_features <= 0 or in_features % values:
        raise UserError(f"{TYPE_NAMES[qtype]} weight: in_features {in_features} is not a multiple of its block "
                        f"size {values}")
    return in_features // values * nbytes


def check_blocks(blocks: Tensor, qtype: int, out_features: int, in_features: int, name: str = "weight") -> Tensor:
    """`blocks` as the contiguous uint8 [out_features, row bytes] the kernels read; UserError naming `name` when its
    byte length does not fit the shape (a truncated or malformed tensor)."""
    nbytes = row_bytes(qtype, in_features)
    if blocks.dtype != torch.uint8:
        raise UserError(f"{name}: GGUF blocks must be uint8 bytes, got {blocks.dtype}")
    if blocks.numel() != out_features * nbytes:
        raise UserError(f"{name}: {blocks.numel()} bytes of {TYPE_NAMES[qtype]} blocks, but a [{out_features}, "
                        f"{in_features}] weight takes {out_features * nbytes} ({nbytes} per row): truncated or "
                        f"malformed")
    return blocks.reshape(out_features, nbytes).contiguous()


def matmul(x: Tensor, blocks: Tensor, qtype: int, out_features: int, int8: bool = True,
           bias: Tensor | None = None) -> Tensor:
    """x [M, K] float32 times the [out_features, K] weight held in `blocks` (transposed), plus `bias` (float32
    [out_features], added to each dot product as a separate add would) -> [M, out_features]."""
    return _ops().matmul(x, blocks, qtype, out_features, int8, bias)


def pack(blocks: Tensor, qtype: int, out_features: int, in_features: int) -> Tensor:
    """A Q4_K or Q6_K weight's blocks [out_features, row bytes] (out_features a multiple of PACK_ROWS) in the layout
    `matmul` multiplies fastest, type PACKED[qtype] (8-bit activations; every output the same bits whatever the batch,
    as with the file's layout, though not the same bits as it): [out_features / 16, 16 * row bytes] uint8 (Q4_K: 148
    bytes a row and super-block, the scales unpacked; Q6_K: 210, the file's), the same values (`dequantize(packed,
    PACKED[qtype], in_features)` gives the file's weight bit for bit)."""
    return _ops().pack(blocks, qtype, out_features, in_features)


def packs(qtype: int, out_features: int, int8: bool = True) -> bool:
    """Whether a [out_features, *] weight of GGML type `qtype` goes packed (PACKED[qtype]): with 8-bit activations and
    a multiple of PACK_ROWS rows, Q4_K everywhere, Q6_K where the kernels run AVX-512 VNNI (streamed, 8960 x 1536:
    level with the file's layout or faster at one row, 1.1-1.8x faster at 4-32 rows; its packed AVX2 kernel 1.08x
    slower at one row and 1.13x faster at 8 on Zen 4, docs/results/gguf-kernels.md). Every kernel takes both layouts;
    the layout decides the bits (each layout the same bits on every instruction set), so a Q6_K layer rounds
    differently on an AVX2-only CPU than on an AVX-512 one."""
    if not (int8 and qtype in PACKED and out_features % PACK_ROWS == 0):
        return False
    return qtype != Q6_K or isa() == "avx512_vnni"


def kernel_blocks(blocks: Tensor, qtype: int, out_features: int, in_features: int,
                  int8: bool = True) -> tuple[Tensor, int]:
    """(the bytes `matmul` runs a weight of GGML type `qtype` on, the type to pass it): packed where `packs` says
    so, else the file's blocks as they are. The one place that decides a weight's layout."""
    if packs(qtype, out_features, int8):
        return pack(blocks, qtype, out_features, in_features), PACKED[qtype]
    return blocks, qtype


def dequantize(blocks: Tensor, qtype: int, in_features: int) -> Tensor:
    """The float32 [rows, in_features] weight held in `blocks` (as gguf.quants.dequantize gives it)."""
    return _ops().dequantize(blocks, qtype, in_features)


def quantize_activations(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """x [M, K] -> (int8 [M, K], float32 scales [M, K / block]): the 8-bit activations `matmul` multiplies."""
    return _ops().quantize_activations(x, block)


ISAS = ("scalar", "avx2", "avx512_vnni")  # narrowest first


def isa() -> str:
    """The instruction set the 8-bit-activation kernels run with: 'avx512_vnni' (AVX-512 F / BW / VL + VNNI: the
    AVX2 kernels' bits in fewer instructions), 'avx2' or 'scalar'."""
    return _ops().isa()


def set_isa(name: str) -> None:
    """'scalar' (the portable kernels), 'avx2', 'avx512_vnni' or 'auto' (the widest this CPU has): for tests and
    measurements; RuntimeError for a set this CPU lacks."""
    _ops().set_isa(name)
