"""Value objects that cross the boundaries between drafter, target, verifier and engine."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from sparrow.tree import chain_parents


@dataclass(frozen=True)
class Prompt:
    """What the target (and a drafter) prefill with."""

    input_ids: Tensor  # [n] int64, target vocabulary
    model_inputs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the prefill forward only (pixel_values, image_grid_thw, ...)."""

    def __post_init__(self) -> None:
        assert self.input_ids.ndim == 1, f"Prompt.input_ids must be 1-D, got {tuple(self.input_ids.shape)}"


@dataclass(frozen=True)
class Draft:
    """A proposed continuation of the committed tokens, in the *target* vocabulary: a chain, or a tree.

    A tree is a list of nodes in topological order: `parents[i]` is the index of node i's parent,
    -1 for the root (the last committed token), and always < i. A chain is the tree in which every
    node's parent is the node before it; `parents is None` stands for that chain.
    Siblings (nodes with the same parent) are tried in index order by the verifiers.
    """

    tokens: Tensor  # [n] int64, n >= 0
    probs: Tensor | None = None
    """[n, vocab] draft distribution q node i was *sampled* from (siblings sampled i.i.d. share their
    parent's q); None means every node is a deterministic proposal (argmax, top-k children, n-gram),
    which the rejection verifier treats with the q = 1 rule."""
    parents: Tensor | None = None  # [n] int64, -1 = root; None = chain

    def __post_init__(self) -> None:
        assert self.tokens.ndim == 1, f"Draft.tokens must be 1-D, got {tuple(self.tokens.shape)}"
        n = self.tokens.numel()
        if self.probs is not None:
            assert self.probs.ndim == 2 and self.probs.shape[0] == n, (
                f"Draft.probs must be [n, vocab] with n={n}, got {tuple(self.probs.shape)}"
            )
        if self.parents is not None:
            assert self.parents.shape == (n,), f"Draft.parents must be [{n}], got {tuple(self.parents.shape)}"
            assert bool((self.parents < torch.arange(n, device=self.parents.device)).all()) and (
                n == 0 or int(self.parents.min()) >= -1
            ), f"Draft.parents must satisfy -1 <= parents[i] < i: {self.parents}"

    def __len__(self) -> int:
        return self.tokens.numel()

    @cached_property  # read several times a round; computed (one host sync) once
    def is_tree(self) -> bool:
        """True unless the draft is a chain (parents None, or each node's parent is the previous node)."""
        if self.parents is None:
            return False
        return not bool((self.parents == chain_parents(len(self), self.parents.device)).all())

    @staticmethod
    def empty(device: torch.device | str) -> Draft:
        return Draft(tokens=torch.empty(0, dtype=torch.long, device=device))


@dataclass(frozen=True)
class Verdict:
    """What the verifier decided for one round."""

    tokens: Tensor  # [num_accepted + 1]: the accepted draft path, then one bonus or recovered token
    num_accepted: int  # 0 .. depth of the draft
    path: Tensor | None = None
    """[num_accepted] int64 indices of the accepted draft nodes, root to leaf; None means the chain
    prefix arange(num_accepted)."""
    ids: tuple[int, ...] | None = None
    """`tokens` on the host, when the verifier read them there anyway (None: read once by `host_ids`); on a GPU
    each read is a device-to-host copy that waits for the device."""

    def __post_init__(self) -> None:
        assert self.tokens.ndim == 1 and self.tokens.numel() == self.num_accepted + 1, (
            f"Verdict.tokens must hold num_accepted + 1 = {self.num_accepted + 1} tokens, got "
                f"{tuple(self.tokens.shape)}"
        )
        if self.path is not None:
            assert self.path.shape == (self.num_accepted,), (tuple(self.path.shape), self.num_accepted)
        assert self.ids is None or len(self.ids) == self.num_accepted + 1, (self.ids, self.num_accepted)

    def host_ids(self) -> list[int]:
        """The committed tokens as Python ints (one device-to-host copy at most)."""
        return list(self.ids) if self.ids is not None else self.tokens.tolist()

    @property
    def accepted_nodes(self) -> Tensor:
        """[num_accepted] draft node indices kept (the chain prefix when `path` is None)."""
        if self.path is not None:
            return self.path
        return torch.arange(self.num_accepted, device=self.tokens.device)


@dataclass(frozen=True)
class TargetOutput:
    """The target's outputs for some rows of one forward: logits, and the hidden states drafters asked for."""

    logits: Tensor  # [n, vocab]
    hidden: Tensor | None = None
    """[len(layers), m, hidden] hidden states of the requested layers (transformers' `hidden_states`
    indexing: 0 = embeddings, i = output of decoder layer i, num_layers = final, after the last norm);
    None when no drafter asked for any. m == n, except after a prefill: its logits cover only the last
    prompt row (m >= n; rows aligned at the end), its hidden states every prompt row."""

    def __post_init__(self) -> None:
        assert self.logits.ndim == 2, f"TargetOutput.logits must be [n, vocab], got {tuple(self.logits.shape)}"
        if self.hidden is not None:
            assert self.hidden.ndim == 3 and self.hidden.shape[1] >= self.logits.shape[0], (
                f"TargetOutput.hidden must be [layers, >= {self.logits.shape[0]}, d], got {tuple(self.hidden.shape)}")

    def rows(self, index: Tensor) -> TargetOutput:
        """The outputs of the rows `index` ([m] int64)."""
        index = index.to(self.logits.device)
        hidden = None if self.hidden is None else self.hidden.index_select(1, index.to(self.hidden.device))
        return TargetOutput(self.logits.index_select(0, index), hidden)


@dataclass(frozen=True)
class StepStats:
    """One speculative round."""

    num_draft_tokens: int  # draft nodes verified (the tree's size, or the chain's length)
    num_accepted: int
    draft_seconds: float
    verify_seconds: float  # the target's scoring forward and the verifier, measured by the engine
    tree: bool = False  # the draft was a tree (a chain otherwise)
    first_branch: bool = True  # the accepted path was the first-child spine (always, for chains)


@dataclass(frozen=True)
class GenerationStats:
    """Aggregate statistics of one generation (vLLM's metric names where they exist)."""

    steps: int  # target forwards after prefill (speculative rounds, or plain decoding steps)
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: tuple[int, ...]  # [max k]: how often draft position i was accepted
    drafted_per_position: tuple[int, ...]  # [max k]: how often draft position i was proposed
    prefill_seconds: float
    draft_seconds: float
    verify_seconds: float
    tree_steps: int = 0  # rounds whose draft was a tree
    branch_steps: int = 0  # rounds where the accepted path was not the first-child spine of the tree

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens committed per target forward, the bonus token included (1.0 for plain decoding)."""
        return (self.num_accepted_tokens + self.steps) / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_per_position(self) -> tuple[float, ...]:
        return tuple(a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position))

    @staticmethod
    def from_steps(steps: list[StepStats], prefill_seconds: float) -> GenerationStats:
        reach = [s.num_draft_tokens if not s.tree else s.num_accepted + 1 for s in steps]  # depths a round drafted
        width = max(reach, default=0)
        accepted, drafted = [0] * width, [0] * width
        for s, r in zip(steps, reach):  # per position = per depth; a tree counts the depths its path reached
            for i in range(r):
                drafted[i] += 1
                accepted[i] += i < s.num_accepted
        return GenerationStats(
            steps=len(steps),
            num_draft_tokens=sum(s.num_draft_tokens for s in steps),
            num_accepted_tokens=sum(s.num_accepted for s in steps),
            accepted_per_position=tuple(accepted),
            drafted_per_position=tuple(drafted),
            prefill_seconds=prefill_seconds,
            draft_seconds=sum(s.draft_seconds for s in steps),
            verify_seconds=sum(s.verify_seconds for s in steps),
            tree_steps=sum(s.tree for s in steps),
            branch_steps=sum(not s.first_branch for s in steps),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "mean_accepted_tokens": self.mean_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_per_position": list(self.acceptance_per_position),
            "prefill_seconds": self.prefill_seconds,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "tree_steps": self.tree_steps,
            "branch_steps": self.branch_steps,
        }


@dataclass(frozen=True)
class Decoded:
    """What a decoding loop (speculative or plain) returns: the new tokens, why it stopped, its statistics."""

    token_ids: list[int]  # new tokens only, already cut by EOS / stop string / max_new_tokens
    finish_reason: str  # "stop" or "length"
    stats: GenerationStats


@dataclass(frozen=True)
class Ran:
    """What ran a generation (`GenerationResult.ran`), read from its pipeline and drafter when it ended, so that a
    caller (the CLI's report, bench's rows) says what was used without reaching into the pipeline."""

    drafter: str  # "none": plain decoding
    dtype: str  # the target's ("float32", "bfloat16", ...)
    quant: str | None  # the target's weight format (--quant, or what auto chose); None: dense
    draft_quant: str | None  # the format of the drafter's own model; None: dense, or no model of its own
    compiled: bool  # the target on the compiled static-cache runner
    draft_compiled: bool  # the draft model likewise
    exact: bool  # batch-invariant verification
    verifier: str  # as asked: "auto" (greedy at temperature 0, else rejection sampling), or the one named
    tree: tuple[int, int, int] | None = None  # (budget, topk, depth) of the trees it drafts; None: chains
    draft_vocab: int | None = None  # tokens its drafts score (FR-Spec); None: the full vocabulary
    rounds_per_option: Mapping[str, int] | None = None  # auto: rounds each option drafted (or ran plain)


@dataclass(frozen=True)
class GenerationResult:
    """Output of one generation: new tokens only (the prompt is not repeated)."""

    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or stop string), "length" (max_new_tokens or context)
    seconds: float  # wall time of the whole generation, prefill included
    stats: GenerationStats
    ran: Ran | None = None  # what ran it (None: built by hand)

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0
