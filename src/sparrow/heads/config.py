"""The shape of an EAGLE head (`HeadConfig`) and the target layers it reads by default."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sparrow.errors import UserError

ARCHS = ("eagle3", "eagle1")
HEAD_ARCHS = (*ARCHS, "sparrow", "longspec")
"""Every arch `sparrow.heads.eagle.new_head` builds: the EAGLE ones (HeadConfig), Sparrow's (an EAGLE-3 head with a
SparrowSpec, sparrow.heads.sparrow_head) and LongSpec's (its own LongSpecConfig, sparrow.heads.longspec)."""
FUSIONS = ("concat", "gated")
"""How a head mixes the target feature with the token embedding: EAGLE's concatenation (EAGLE-1: fc over
cat(e, f); EAGLE-3: the layer's attention reads cat(norm(e), norm(h))), or Dovetail's dynamic gating fusion
(`sparrow.heads.fusion`)."""


def default_layers(arch: str, num_layers: int) -> tuple[int, ...]:
    """The target hidden states a head reads: EAGLE-3 the inputs of layers 2, L // 2, L - 3 (clipped and sorted
    for targets with fewer than 6 layers); EAGLE-1 the final one (L: after the target's last norm)."""
    if arch == "eagle1":
        return (num_layers,)
    return tuple(sorted((min(2, num_layers), num_layers // 2, max(num_layers - 3, 0))))


@dataclass(frozen=True)
class HeadConfig:
    """The shape of a head; `layout` reads and writes it as a Llama-style config.json."""

    arch: str  # "eagle3" or "eagle1"
    hidden_size: int  # d: the head's width, = the target's embedding width
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary (logit width)
    draft_vocab_size: int  # rows of the head's own lm_head (EAGLE-3); = vocab_size for EAGLE-1
    target_layers: tuple[int, ...]  # transformers' hidden_states indices the head reads, low to high
    target_hidden_size: int  # D: width of one target hidden state
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    rope_scaling: dict[str, Any] | None = field(default=None, compare=False)
    fc_bias: bool = False
    hidden_act: str = "silu"
    fusion: str = "concat"  # one of FUSIONS; "gated" heads are sparrow-only (serving engines read "concat")
    num_layers: int = 1  # decoder layers (Dovetail: deeper heads); > 1 is sparrow-only for EAGLE-3

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise UserError(f"head arch must be one of {', '.join(ARCHS)}, got {self.arch!r}")
        if self.fusion not in FUSIONS:
            raise UserError(f"head fusion must be one of {', '.join(FUSIONS)}, got {self.fusion!r}")
        if self.num_layers < 1:
            raise UserError(f"a head needs at least 1 decoder layer, got layers={self.num_layers}")
        if self.arch == "eagle3" and len(self.target_layers) != 3:
            raise UserError(f"an EAGLE-3 head fuses 3 target layers, got {self.target_layers}")
        if self.arch == "eagle1" and (len(self.target_layers) != 1 or self.draft_vocab_size != self.vocab_size):
            raise UserError("an EAGLE-1 head reads 1 target layer and uses the target's full vocabulary")
        if self.num_attention_heads % self.num_key_value_heads:
            raise UserError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                            f"num_key_value_heads ({self.num_key_value_heads})")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise UserError(f"draft_vocab_size must be in 1..vocab_size ({self.vocab_size}), "
                            f"got {self.draft_vocab_size}")

    @property
    def fused_width(self) -> int:
        """Width of the target features the head reads per position: len(target_layers) * D."""
        return len(self.target_layers) * self.target_hidden_size

    @staticmethod
    def for_target(target_config: Any, arch: str = "eagle3", draft_vocab_size: int | None = None,
                   target_layers: tuple[int, ...] | None = None, intermediate_size: int | None = None,
                   vocab_size: int | None = None) -> HeadConfig:
        """A head shaped like one layer of the target (its text config), as SpecForge's configs are."""
        c = target_config
        d, heads = c.hidden_size, c.num_attention_heads
        vocab = vocab_size or c.vocab_size
        return HeadConfig(
            arch=arch, hidden_size=d, intermediate_size=intermediate_size or c.intermediate_size,
            num_attention_heads=heads, num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=getattr(c, "head_dim", None) or d // heads, vocab_size=vocab,
            draft_vocab_size=vocab if arch == "eagle1" else (draft_vocab_size or vocab),
            target_layers=tuple(target_layers or default_layers(arch, c.num_hidden_layers)), target_hidden_size=d,
            rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6), rope_theta=_rope_theta(c),
            max_position_embeddings=getattr(c, "max_position_embeddings", 4096))


def _rope_theta(config: Any) -> float:
    parameters = getattr(config, "rope_parameters", None) or {}
    return float(parameters.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
