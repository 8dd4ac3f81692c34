"""Linear and embedding layers whose weights stay in GGUF's own block bytes (Q8_0, Q4_K, Q6_K), multiplied by the
kernels of `sparrow.runtime.gguf_kernels`.

A `GGUFLinear` holds the raw blocks (typically a view of the memory-mapped file: no float copy; Q4_K, and Q6_K where
the kernels run AVX-512 VNNI, repacked at construction 16 rows at a time, `gguf_kernels.pack`), the shape and the
GGML type. Its forward is batch-invariant by construction (each output row of the kernel depends on its own input
row only), so a verify forward over k tokens gives bit for bit what k one-token steps give, and speculation on a
GGUF target is exact without any extra work for these layers. `GGUFEmbedding` dequantizes only the rows it looks up.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from sparrow.runtime import gguf_kernels as gk


class GGUFLinear(nn.Module):
    """y = x W^T + b with W kept as GGUF blocks [out_features, row bytes] uint8 of GGML type `qtype`.

    int8: activations quantized to 8 bits per row and multiplied in integers (llama.cpp's numerics, the fast path);
    else float activations times the dequantized weight (the dequantized model's weights, float32 sums)."""

    def __init__(self, blocks: Tensor, qtype: int, out_features: int, in_features: int, bias: Tensor | None = None,
                 int8: bool = True, name: str = "weight") -> None:
        super().__init__()
        self.in_features, self.out_features, self.qtype, self.int8 = in_features, out_features, qtype, int8
        blocks = gk.check_blocks(blocks, qtype, out_features, in_features, name)
        self.source = blocks
        """The blocks as given (the file's layout; typically a view of the memory-mapped file, whose pages the loader
        releases where the layer packs its own copy: kept for `rows`, costing no memory until it is read)."""
        # the kernel's type: Q4_K (and Q6_K where the kernels run AVX-512 VNNI, see gk.packs) goes packed, 16 rows
        # interleaved, made once here (products of several rows 1.3-2.3x faster, see gguf_kernels.cpp); the other
        # formats stay the file's bytes
        blocks, self.kernel_type = gk.kernel_blocks(blocks, qtype, out_features, in_features, int8)
        self.register_buffer("blocks", blocks)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    @property
    def weight(self) -> Tensor:
        """A data-less [out_features, in_features] stand-in for code that reads `.weight.shape` (an LM head's width);
        `dequantized()` gives the values."""
        return torch.empty(self.out_features, self.in_features, dtype=torch.float32, device="meta")

    def rows(self, ids: Tensor) -> GGUFLinear:
        """The output rows `ids` ([n] int64) as a GGUFLinear of the same GGML type, from the file's blocks of those
        rows (laid out as `kernel_blocks` decides for n rows): a draft's reduced vocabulary
        (`sparrow.drafters.vocab`). Its outputs are this layer's columns `ids` where both take the same layout."""
        ids = ids.to(self.source.device)
        bias = None if self.bias is None else self.bias.detach()[ids]
        return GGUFLinear(self.source.index_select(0, ids), self.qtype, ids.numel(), self.in_features, bias, self.int8)

    def dequantized(self) -> Tensor:
        """The float32 weight [out_features, in_features] (bit for bit gguf.quants.dequantize's)."""
        return gk.dequantize(self.blocks, self.kernel_type, self.in_features)

    def forward(self, x: Tensor) -> Tensor:
        # x [..., in_features] -> [..., out_features]; the conversions only where needed (each call is a few
        # microseconds of Python, and a 1.5B model's step makes 197 of these)
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            rows = rows.to(torch.float32).contiguous()
        y = torch.ops.sparrow_gguf.matmul(rows, self.blocks, self.kernel_type, self.out_features, self.int8, self.bias)
        if x.dtype != torch.float32:
            y = y.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        mode = "8-bit activations" if self.int8 else "float activations"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{gk.TYPE_NAMES.get(self.kernel_type, self.kernel_type)}, {mode}")


class GGUFEmbedding(nn.Module):
    """An embedding table kept as GGUF blocks; a lookup dequantizes the rows it takes (exactly as gguf does)."""

    def __init__(self, blocks: Tensor, qtype: int, num_embeddings: int, embedding_dim: int,
                 name: str = "token_embd.weight") -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.qtype = num_embeddings, embedding_dim, qtype
        self.register_buffer("blocks", gk.check_blocks(blocks, qtype, num_embeddings, embedding_dim, name))

    @property
    def weight(self) -> Tensor:
        """A data-less [num_embeddings, embedding_dim] stand-in (see GGUFLinear.weight)."""
        return torch.empty(self.num_embeddings, self.embedding_dim, dtype=torch.float32, device="meta")

    def forward(self, ids: Tensor) -> Tensor:
        rows = self.blocks.index_select(0, ids.reshape(-1).to(self.blocks.device))
        return gk.dequantize(rows, self.qtype, self.embedding_dim).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {gk.TYPE_NAMES.get(self.qtype, self.qtype)}"
