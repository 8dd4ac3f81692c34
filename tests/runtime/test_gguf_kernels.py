"""The GGUF block kernels (sparrow.runtime.gguf_kernels) against references: dequantization bit for bit the `gguf`
package's, on random blocks and on the real blocks of any installed preset; the matmul within stated bounds of a
float64 reference, in both activation modes and on every instruction set this CPU has (AVX-512 VNNI bit for bit
AVX2's); batch-invariant bit for bit (k rows at once equal k one-row calls, at any thread count); malformed blocks
refused."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from sparrow.errors import UserError
from sparrow.runtime import gguf_kernels as gk

pytestmark = pytest.mark.skipif(not gk.available(), reason="the GGUF kernels could not be built here")

TYPES = (gk.Q5_0, gk.Q8_0, gk.Q4_K, gk.Q6_K)
ISAS = gk.ISAS[:gk.ISAS.index(gk.isa()) + 1] if gk.available() else ("scalar",)  # this CPU's, narrowest first


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest):
    gk.set_isa(request.param)
    yield request.param
    gk.set_isa("auto")


def random_blocks(qtype: int, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Random bytes with finite, modest fp16 scales: [rows, row bytes] uint8."""
    rng = np.random.default_rng(seed)
    values, nbytes = gk.BLOCKS[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // values, nbytes), dtype=np.uint8)
    for offset in gk.SCALE_OFFSETS[qtype]:
        scale = (rng.uniform(0.2, 1.0, size=blocks.shape[0]) * 10.0 ** rng.integers(-4, -1, blocks.shape[0]))
        blocks[:, offset:offset + 2] = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(blocks.reshape(rows, -1))


def reference(blocks: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
    """gguf's own dequantization."""
    out = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType(qtype))
    return torch.from_numpy(np.ascontiguousarray(out)).reshape(blocks.shape[0], cols)


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_equals_gguf_bit_for_bit(qtype: int, isa: str):
    cols = 512
    blocks = random_blocks(qtype, 24, cols, seed=qtype)
    mine = gk.dequantize(blocks, qtype, cols)
    assert torch.equal(mine.view(torch.int32), reference(blocks, qtype, cols).view(torch.int32))


def _installed_ggufs() -> list[Path]:
    from sparrow.paths import default_cache_dir

    found = sorted((default_cache_dir() / "gguf").glob("*.gguf"))
    return found or sorted((Path.home() / ".cache" / "sparrow" / "gguf").glob("*.gguf"))


def test_dequantize_equals_gguf_on_real_blocks():
    files = _installed_ggufs()
    if not files:
        pytest.skip("no preset GGUF installed")
    checked = set()
    for path in files[:3]:
        reader = gguf.GGUFReader(path)
        for tensor in reader.tensors:
            qtype = int(tensor.tensor_type)
            if qtype not in gk.BLOCKS or len(tensor.shape) != 2:
                continue
            cols = int(tensor.shape[0])
            raw = torch.from_numpy(np.array(tensor.data[:64]))  # the first 64 rows (bytes [rows, row bytes])
            assert torch.equal(gk.dequantize(raw, qtype, cols).view(torch.int32),
                               reference(raw, qtype, cols).view(torch.int32)), (path.name, tensor.name)
            checked.add(qtype)
    assert checked  # at least one tensor of a supported type in the installed presets


def _bound(w: torch.Tensor, x: torch.Tensor, rel: float) -> torch.Tensor:
    """rel * sum |w| |x| per output: the scale of float32 rounding in a dot product."""
    return rel * (x.abs().double() @ w.abs().double().T)


@pytest.mark.parametrize("qtype", TYPES)
def test_float_activations_match_the_dequantized_product(qtype: int, isa: str):
    cols, rows = 768, 40
    blocks = random_blocks(qtype, rows, cols, seed=1)
    w = reference(blocks, qtype, cols)
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(0))
    y = gk.matmul(x, blocks, qtype, rows, int8=False)
    exact = x.double() @ w.double().T
    assert ((y.double() - exact).abs() <= _bound(w, x, 1e-5)).all()


@pytest.mark.parametrize("qtype", TYPES)
def test_int8_activations_are_exact_integer_dots(qtype: int, isa: str):
    """Against float64 on the 8-bit activations the kernel made: only float32 rounding of the per-block scales
    separates them; against the float activations, at most half an activation step per weight."""
    cols, rows = 768, 40
    block = gk.BLOCKS[qtype][0]
    blocks = random_blocks(qtype, rows, cols, seed=2)
    w = reference(blocks, qtype, cols)
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(1))
    x[1] = 0.0  # a zero row: scale 0
    x[2, :block] = 0.0  # a zero block
    y = gk.matmul(x, blocks, qtype, rows, int8=True)
    q, d = gk.quantize_activations(x, block)
    xq = (q.double().reshape(5, -1, block) * d.double()[..., None]).reshape(5, cols)
    assert ((y.double() - xq @ w.double().T).abs() <= _bound(w, xq, 1e-5)).all()
    step = d.double().repeat_interleave(block, dim=1)  # [5, cols]: each activation's quantization step
    bound = (step / 2) @ w.abs().double().T + _bound(w, x, 1e-5)
    assert ((y.double() - x.double() @ w.double().T).abs() <= bound).all()
    assert (y[1] == 0).all()


def test_activation_quantization():
    x = torch.tensor([[0.5, -1.0, 0.25, 0.0] * 8, [0.0] * 32])
    q, d = gk.quantize_activations(x, 32)
    assert d.tolist() == [[pytest.approx(1 / 127)], [0.0]]
    assert q[0, :4].tolist() == [64, -127, 32, 0] and (q[1] == 0).all()  # 63.5 -> 64: half to even


def test_activation_quantization_is_the_same_on_every_instruction_set():
    """The AVX2 quantization of activations gives the scalar code's bytes and scales bit for bit: ties (half to even),
    zero blocks, NaN (ignored by the max, then -127) and infinities included."""
    if "avx2" not in ISAS:
        pytest.skip("no AVX2 here")
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(5)) * 4
    x[1] = torch.arange(512) % 9 - 4.0  # amax 4: 127 / 4 * odd values hit halves
    x[2, :256] = 0.0
    x[3, 7], x[3, 300] = float("nan"), float("inf")
    x[4, 40] = -float("inf")
    x[5] = 1e-39  # subnormal
    for block in (32, 256):
        out = {}
        for name in ISAS:
            gk.set_isa(name)
            out[name] = gk.quantize_activations(x, block)
        gk.set_isa("auto")
        assert torch.equal(out["scalar"][0], out["avx2"][0]), block
        scalar, avx2 = out["scalar"][1], out["avx2"][1]
        assert torch.equal(scalar.isnan(), avx2.isnan()) and torch.equal(scalar.nan_to_num(), avx2.nan_to_num()), block


def assert_batch_invariant(product, x: torch.Tensor, ks: tuple[int, ...]) -> None:
    """product(x[i:j]) equals the one-row products of those rows bit for bit, for k = j - i in ks taken from either
    end of x, at 1 and 2 threads."""
    singles = torch.cat([product(x[i:i + 1]) for i in range(len(x))])
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for k in ks:
                for start in (0, len(x) - k):
                    assert torch.equal(product(x[start:start + k]), singles[start:start + k]), (k, start, n_threads)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("int8", [True, False])
@pytest.mark.parametrize("qtype", TYPES)
def test_batch_invariant_bit_for_bit(qtype: int, int8: bool, isa: str):
    """k rows at once give what k one-row calls give, bit for bit, for every k (balanced tiles of up to 8 rows with
    8-bit activations, 4 with float ones) and at 1 or 2 threads."""
    cols, rows = 512, 72
    blocks = random_blocks(qtype, rows, cols, seed=3)
    x = torch.randn(19, cols, generator=torch.Generator().manual_seed(2)) * 3
    assert_batch_invariant(lambda rows_x: gk.matmul(rows_x, blocks, qtype, rows, int8), x,
                           (2, 3, 4, 5, 7, 8, 9, 11, 17, 19))


@pytest.mark.parametrize("qtype", TYPES)
def test_a_long_forward_in_row_blocks_keeps_its_rows(qtype: int, isa: str):
    """A prefill-sized forward whose 8-bit activations exceed a row block (256 KiB: 70 rows of 8960 go as 3 blocks of
    tiles, every weight row passing each block) gives each row's one-row product bit for bit, with a bias."""
    cols, rows = 8960, 6
    blocks = random_blocks(qtype, rows, cols, seed=10)
    x = torch.randn(70, cols, generator=torch.Generator().manual_seed(10))
    bias = torch.randn(rows, generator=torch.Generator().manual_seed(11))
    singles = torch.cat([gk.matmul(x[i:i + 1], blocks, qtype, rows, True, bias) for i in range(len(x))])
    assert torch.equal(gk.matmul(x, blocks, qtype, rows, True, bias), singles)


@pytest.mark.parametrize("int8", [True, False])
def test_the_bias_is_added_as_a_separate_add_would(int8: bool):
    blocks = random_blocks(gk.Q4_K, 24, 512, seed=6)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(6))
    bias = torch.randn(24, generator=torch.Generator().manual_seed(7))
    assert torch.equal(gk.matmul(x, blocks, gk.Q4_K, 24, int8, bias), gk.matmul(x, blocks, gk.Q4_K, 24, int8) + bias)
    with pytest.raises(RuntimeError, match="bias must be a float32 \\[out_features\\]"):
        gk.matmul(x, blocks, gk.Q4_K, 24, int8, bias[:5])


def test_the_instruction_sets_agree():
    """Scalar and AVX2 compute the same integer dots and the same dequantized weights; float sums differ in order
    only (a few ulps)."""
    if "avx2" not in ISAS:
        pytest.skip("no AVX2 here")
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(3))
    for qtype in TYPES:
        blocks = random_blocks(qtype, 16, 512, seed=4)
        out = {}
        for name in ISAS:
            gk.set_isa(name)
            out[name] = (gk.matmul(x, blocks, qtype, 16, True), gk.matmul(x, blocks, qtype, 16, False))
        gk.set_isa("auto")
        for a, b in zip(out["scalar"], out["avx2"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("qtype", "cols"), [*((t, 1536) for t in TYPES), (gk.Q5_0, 1568), (gk.Q8_0, 1568)],
                         ids=[*map(str, TYPES), "Q5_0-odd-blocks", "Q8_0-odd-blocks"])
def test_avx512_vnni_gives_the_avx2_bits(qtype: int, cols: int):
    """The AVX-512 VNNI kernels are the AVX2 kernels' integers and float steps in fewer instructions: every output
    bit for bit the same, for every tile size (1..8 rows and two tiles), with a bias, on real-sized rows, so a model
    decodes identically on both. A planted change (one weight byte) must show. (Q5_0 and Q8_0 run two blocks a
    register: 49 blocks a row leave one for the 256-bit tail.)"""
    if "avx512_vnni" not in ISAS:
        pytest.skip("no AVX-512 VNNI here")
    rows = 24
    blocks = random_blocks(qtype, rows, cols, seed=8)
    x = torch.randn(19, cols, generator=torch.Generator().manual_seed(8)) * 3
    bias = torch.randn(rows, generator=torch.Generator().manual_seed(9))
    out = {}
    for name in ("avx2", "avx512_vnni"):
        gk.set_isa(name)
        out[name] = [gk.matmul(x[:k], blocks, qtype, rows, True, bias) for k in (1, 2, 3, 4, 5, 6, 7, 8, 9, 19)]
    gk.set_isa("auto")
    for k, (a, b) in enumerate(zip(out["avx2"], out["avx512_vnni"])):
        assert torch.equal(a, b), k
    planted = blocks.clone()
    planted[3, 100] ^= 0x11  # a weight byte, not a scale
    gk.set_isa("avx512_vnni")
    try:
        assert not torch.equal(gk.matmul(x[:1], planted, qtype, rows, True, bias), out["avx2"][0])
    finally:
        gk.set_isa("auto")


def test_an_instruction_set_this_cpu_lacks_is_refused():
    with pytest.raises(RuntimeError, match="unknown isa"):
        gk.set_isa("avx1024")
    missing = [name for name in gk.ISAS if name not in ISAS]
    for name in missing:
        with pytest.raises(RuntimeError, match="this CPU has no"):
            gk.set_isa(name)
    assert gk.isa() == ISAS[-1]


def test_malformed_blocks_are_refused():
    blocks = random_blocks(gk.Q4_K, 8, 512)
    with pytest.raises(UserError, match="truncated or malformed"):
        gk.check_blocks(blocks.reshape(-1)[:-1], gk.Q4_K, 8, 512, "blk.0.ffn_up.weight")
    with pytest.raises(UserError, match="not a multiple of its block size 256"):
        gk.check_blocks(blocks, gk.Q4_K, 8, 500)
    with pytest.raises(UserError, match="no GGUF kernel"):
        gk.row_bytes(gguf.GGMLQuantizationType.Q5_1.value, 512)
    with pytest.raises(RuntimeError, match="bytes"):  # the op itself checks too
        gk.matmul(torch.randn(1, 512), blocks.reshape(-1)[:-144], gk.Q4_K, 8)
    with pytest.raises(RuntimeError, match="unsupported GGML type"):
        gk.matmul(torch.randn(1, 512), blocks, 2, 8)


def test_the_micro_benchmark_times_the_gguf_kernel_beside_the_other_formats(monkeypatch):
    """`sparrow doctor`'s measurement has a gguf row (Q4_K blocks, 8-bit activations) where the kernels are built and
    the shape is whole Q4_K blocks; none without the kernels, or for a shape they cannot take."""
    from sparrow.runtime import microbench

    blocks = microbench.gguf_blocks(gk.Q4_K, 64, 256)
    assert blocks.shape == (64, 144) and torch.isfinite(gk.dequantize(blocks, gk.Q4_K, 256)).all()
    record = microbench.measure(rows=(1, 8), shape=(64, 256), working_set=1 << 20)
    assert set(record["costs"]["gguf"]) == {"1", "8"} and all(v > 0 for v in record["costs"]["gguf"].values())
    assert "gguf" not in microbench.measure(rows=(1,), shape=(64, 128), working_set=1 << 20)["costs"]
    monkeypatch.setattr(gk, "available", lambda: False)
    assert "gguf" not in microbench.measure(rows=(1,), shape=(64, 256), working_set=1 << 20)["costs"]


# ---------------------------------------------------------------------------------------------------------------
# Q4_K and Q6_K packed 16 rows at a time (Q4_KX16, Q6_KX16: what GGUFLinear runs those weights on)

PACKABLE = (gk.Q4_K, gk.Q6_K)

def packed_blocks(qtype: int, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the file's blocks, the same packed)."""
    blocks = random_blocks(qtype, rows, cols, seed=seed)
    return blocks, gk.pack(blocks, qtype, rows, cols)


@pytest.mark.parametrize("qtype", PACKABLE)
def test_packing_keeps_every_value_bit_for_bit(qtype: int, isa: str):
    blocks, packed = packed_blocks(qtype, 48, 768, seed=20)
    assert packed.shape == (3, 3 * gk.BLOCKS[gk.PACKED[qtype]][1] * 16)
    assert torch.equal(gk.dequantize(packed, gk.PACKED[qtype], 768).view(torch.int32),
                       reference(blocks, qtype, 768).view(torch.int32))


def test_packing_real_blocks_keeps_every_value():
    files = _installed_ggufs()
    if not files:
        pytest.skip("no preset GGUF installed")
    checked = 0
    for tensor in gguf.GGUFReader(files[0]).tensors:
        qtype = int(tensor.tensor_type)
        if qtype in PACKABLE and len(tensor.shape) == 2 and checked < 8:
            cols = int(tensor.shape[0])
            raw = torch.from_numpy(np.array(tensor.data[:64]))
            packed = gk.pack(raw, qtype, 64, cols)
            assert torch.equal(gk.dequantize(packed, gk.PACKED[qtype], cols).view(torch.int32),
                               reference(raw, qtype, cols).view(torch.int32)), tensor.name
            checked += 1
    if not checked:
        pytest.skip("no Q4_K or Q6_K tensor in the installed preset")


@pytest.mark.parametrize("qtype", PACKABLE)
def test_packed_products_are_exact_integer_dots(qtype: int, isa: str):
    """The same bounds as the file's layout: float64 on the kernel's own 8-bit activations within float32 rounding,
    and close to the file's layout's product (the same integers, other float steps)."""
    cols, rows = 768, 48
    blocks, packed = packed_blocks(qtype, rows, cols, seed=21)
    w = reference(blocks, qtype, cols)
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(21))
    x[1] = 0.0
    x[2, :256] = 0.0
    y = gk.matmul(x, packed, gk.PACKED[qtype], rows, True)
    q, d = gk.quantize_activations(x, 256)
    xq = (q.double().reshape(5, -1, 256) * d.double()[..., None]).reshape(5, cols)
    assert ((y.double() - xq @ w.double().T).abs() <= _bound(w, xq, 1e-5)).all()
    assert (y[1] == 0).all()
    torch.testing.assert_close(y, gk.matmul(x, blocks, qtype, rows, True), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("qtype", PACKABLE)
def test_packed_products_are_batch_invariant_bit_for_bit(qtype: int, isa: str):
    """Every k (tiles of up to 6 rows, 12 on AVX-512), at 1 and 2 threads, and a prefill-sized forward in row blocks
    with a bias."""
    cols, rows = 512, 64
    _, packed = packed_blocks(qtype, rows, cols, seed=22)
    kind = gk.PACKED[qtype]
    x = torch.randn(19, cols, generator=torch.Generator().manual_seed(22)) * 3
    assert_batch_invariant(lambda rows_x: gk.matmul(rows_x, packed, kind, rows, True), x,
                           (2, 3, 4, 5, 6, 7, 8, 11, 13, 19))
    cols = 8960
    _, packed = packed_blocks(qtype, 16, cols, seed=23)
    x = torch.randn(70, cols, generator=torch.Generator().manual_seed(23))
    bias = torch.randn(16, generator=torch.Generator().manual_seed(24))
    singles = torch.cat([gk.matmul(x[i:i + 1], packed, kind, 16, True, bias) for i in range(len(x))])
    assert torch.equal(gk.matmul(x, packed, kind, 16, True, bias), singles)
    assert torch.equal(gk.matmul(x[:3], packed, kind, 16, True, bias),
                       gk.matmul(x[:3], packed, kind, 16, True) + bias)


@pytest.mark.parametrize("qtype", PACKABLE)
def test_packed_products_are_the_same_bits_on_every_instruction_set(qtype: int):
    """Scalar, AVX2 and AVX-512 VNNI: the same integers and the same float steps lane for lane (fused where the
    vector code fuses), so the same bits, for every tile size; a planted weight byte must show."""
    if "avx2" not in ISAS:
        pytest.skip("no AVX2 here")
    cols, rows = 1536, 32
    blocks, packed = packed_blocks(qtype, rows, cols, seed=25)
    kind = gk.PACKED[qtype]
    x = torch.randn(13, cols, generator=torch.Generator().manual_seed(25)) * 3
    out = {}
    try:
        for name in ISAS:
            gk.set_isa(name)
            out[name] = [gk.matmul(x[:k], packed, kind, rows, True) for k in (1, 2, 3, 4, 5, 6, 7, 9, 12, 13)]
        for name in ISAS[1:]:
            for k, (a, b) in enumerate(zip(out["scalar"], out[name])):
                assert torch.equal(a, b), (name, k)
        planted = blocks.clone()
        planted[5, 2 * gk.BLOCKS[qtype][1] + 40] ^= 0x11  # a weight byte (row 5, super-block 2), not a scale
        gk.set_isa(ISAS[-1])
        moved = gk.matmul(x[:1], gk.pack(planted, qtype, rows, cols), kind, rows, True)
        assert not torch.equal(moved[:, 5], out["scalar"][0][:, 5])
        assert torch.equal(moved[:, 6:], out["scalar"][0][:, 6:])
    finally:
        gk.set_isa("auto")


def test_packing_refuses_what_it_cannot_pack():
    blocks = random_blocks(gk.Q4_K, 24, 512)
    with pytest.raises(RuntimeError, match="multiple of 16 rows"):
        gk.pack(blocks, gk.Q4_K, 24, 512)
    with pytest.raises(RuntimeError, match="pack takes Q4_K \\(12\\) or Q6_K"):
        gk.pack(random_blocks(gk.Q8_0, 16, 512), gk.Q8_0, 16, 512)
    packed = gk.pack(blocks[:16], gk.Q4_K, 16, 512)
    with pytest.raises(RuntimeError, match="8-bit activations only"):
        gk.matmul(torch.randn(1, 512), packed, gk.Q4_KX16, 16, False)
    with pytest.raises(RuntimeError, match="bytes"):
        gk.matmul(torch.randn(1, 512), packed.reshape(-1)[:-148], gk.Q4_KX16, 16)
    assert gk.packs(gk.Q4_K, 32) and not gk.packs(gk.Q4_K, 24) and not gk.packs(gk.Q8_0, 32)
    assert gk.packs(gk.Q6_K, 32) == (gk.isa() == "avx512_vnni")  # Q6_K packs where its packed kernel is faster
    if "avx2" in ISAS:
        try:
            gk.set_isa("avx2")
            assert gk.packs(gk.Q4_K, 32) and not gk.packs(gk.Q6_K, 32)
        finally:
            gk.set_isa("auto")
    assert not gk.packs(gk.Q4_K, 32, int8=False)
