"""`--drafter eagle` with a LongSpec head (`sparrow.heads.longspec`): drafting with constant memory.

The head keeps the KV of at most `window` committed rows (one row per token; row t reads x[t] and predicts
x[t + 1]) and reads the target's KV cache of one layer in place. Each round:
1. rows for the committed tokens not yet read (at most the last `window`) run, cross-attending to the target's
   keys of earlier positions; the last committed token's row gives the first draft token;
2. each draft token runs one row (its cross-attention sees the target's cache, committed[:-1]);
   (or, with a tree shape, an EAGLE-2 dynamic tree: `dynamic_tree` drives `TreeRunner`, the draft nodes' rows
   seeing the committed rows in the window and their ancestors);
3. the draft rows are dropped and the head's cache trimmed back to the last `window` committed rows, so its
   size does not grow with the context (between rounds: `window` rows; while drafting k tokens, at most
   window - 1 + the newly committed tokens + k - 1). Accepted tokens are re-read next round at their own cross-attention
   horizon, so rejections need no other rollback.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sparrow.config import SamplingConfig
from sparrow.drafters.base import DrafterBase, distinct
from sparrow.drafters.draft_loop import draft_chain, drive
from sparrow.drafters.tree_draft import TreeShape, dynamic_tree
from sparrow.errors import UserError
from sparrow.heads.longspec import LongSpecHead, target_layer_kv, window_mask
from sparrow.noise import Randomness
from sparrow.policy.length import LengthPolicy
from sparrow.runtime.cached_model import CachedModel
from sparrow.types import Draft, Prompt, StepStats, TargetOutput, Verdict


@dataclass
class WindowCache:
    """The head's own KV: rows with their positions, kept to the last `window` committed rows between rounds."""

    keys: Tensor  # [kv_heads, rows, hd]
    values: Tensor  # [kv_heads, rows, hd]
    positions: Tensor  # [rows] int64

    @property
    def rows(self) -> int:
        return self.positions.numel()

    def append(self, keys: Tensor, values: Tensor, positions: Tensor) -> None:
        self.keys, self.values = torch.cat([self.keys, keys], 1), torch.cat([self.values, values], 1)
        self.positions = torch.cat([self.positions, positions])

    def crop(self, rows: int) -> None:
        self.keys, self.values, self.positions = self.keys[:, :rows], self.values[:, :rows], self.positions[:rows]

    def keep_last(self, before: int, window: int) -> None:
        """Keep the rows at positions < before, at most the last `window` of them (copies: constant size)."""
        keep = int((self.positions < before).sum())
        first = max(keep - window, 0)
        self.keys, self.values = self.keys[:, first:keep].clone(), self.values[:, first:keep].clone()
        self.positions = self.positions[first:keep].clone()


class LongSpecDrafter(DrafterBase):
    """Chains of draft tokens from a LongSpec head over the target's KV cache (`hidden_layers` is empty: the
    head reads the target's cache, not its hidden states)."""

    name = "eagle"
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, head: LongSpecHead, num_draft_tokens: int = 6, adaptive: bool = False,
                 tree: TreeShape | None = None) -> None:
        self.head = head
        self.tree = tree
        self.name = "eagle+tree" if tree is not None else "eagle"
        self.length = LengthPolicy(num_draft_tokens, adaptive=adaptive, backoff=adaptive)
        self.target: CachedModel | None = None
        self.cache = self._empty()
        self.done = 0  # committed tokens the head has read

    def _empty(self) -> WindowCache:
        c, w = self.head.config, self.head.weight
        kv = w.new_zeros(c.num_key_value_heads, 0, c.head_dim)
        return WindowCache(kv, kv.clone(), torch.zeros(0, dtype=torch.long, device=w.device))

    def modules(self) -> tuple[torch.nn.Module, ...]:
        return (self.head,)

    def shared(self) -> tuple[object, ...]:
        return distinct((self.target,))  # the last generation's target runner, whose cache it reads

    def prefill(self, prompt: Prompt, target: CachedModel | None = None, out: TargetOutput | None = None) -> None:
        if target is None:
            raise UserError("the LongSpec head reads the target's KV cache: run it through the engine")
        self.target, self.cache, self.done = target, self._empty(), 0
        self.length.reset()

    def _run(self, tokens: Tensor, positions: Tensor, horizon: Tensor, target_kv: tuple[Tensor, Tensor]) -> Tensor:
        """Rows for tokens [n] at positions [n], each cross-attending to the target positions < horizon [n];
        appended to the head's cache. Returns [n, d] output hidden."""
        head = self.head
        keys = torch.cat([self.cache.positions, positions])
        self_mask = window_mask(positions, keys, head.config.window)
        cross_mask = torch.arange(target_kv[0].shape[1], device=positions.device)[None] < horizon[:, None]
        past = (self.cache.keys, self.cache.values) if self.cache.rows else None
        out, k, v = head.step(tokens, positions, self_mask, past, target_kv, cross_mask)
        self.cache.append(k, v, positions)
        return out

    @torch.inference_mode()
    def propose(self, committed: Tensor, max_tokens: int, sampling: SamplingConfig, generator: Randomness) -> Draft:
        assert self.target is not None and self.target.cache is not None, "prefill() must run before propose()"
        device, window = self.head.weight.device, self.head.config.window
        committed = committed.to(device)
        c = committed.numel()
        num_tokens = self.length.cap(max_tokens)
        if num_tokens < 1:
            return Draft.empty(device)
        target_kv = target_layer_kv(self.target.cache, self.head.config.kv_layer)  # views: committed[:-1]
        assert target_kv[0].shape[1] == c - 1, (tuple(target_kv[0].shape), c)
        start = max(self.done, c - window)  # older rows would fall out of the window at once
        if self.tree is not None:
            self.cache.keep_last(start, window - 1)
            runner = TreeRunner(self, start, c, target_kv)
            draft, _ = dynamic_tree(runner, committed, self.tree, num_tokens, sampling)
            self.cache.keep_last(c, window)
            self.done = c
            return draft

        def answer(request: tuple[Tensor, int]) -> Tensor:
            token, i = request
            if i == 0:
                self.cache.keep_last(start, window - 1)  # all the row at `start` can see
                positions = torch.arange(start, c, device=device)
                out = self._run(committed[start:], positions, positions.clamp(max=c - 1), target_kv)
            else:
                position = torch.full((1,), c - 1 + i, device=device)
                out = self._run(token, position, position.new_full((1,), c - 1), target_kv)
            return self.head.logits(out[-1:])[-1]

        draft = drive(draft_chain(lambda token, i: (token, i), committed[-1:], num_tokens, sampling, generator,
                                  self.length), answer)
        self.cache.keep_last(c, window)  # drop the draft rows; the window of committed rows stays
        self.done = c
        return draft

    def observe(self, draft: Draft, verdict: Verdict, out: TargetOutput | None = None,
                step: StepStats | None = None) -> None:
        self.length.observe(step)


class TreeRunner:
    """The LongSpec head as the CachedModel-like object `dynamic_tree` drives, over token slots: slot t < c is the
    row of committed token t; tree nodes take slots c, c + 1, .. at their depth positions, under the tree's mask
    (and the window). Every row cross-attends to the whole target cache (committed[:-1])."""

    def __init__(self, drafter: LongSpecDrafter, start: int, committed: int, target_kv: tuple[Tensor, Tensor]) -> None:
        self.drafter, self.target_kv, self.committed = drafter, target_kv, committed
        self.length = start  # slots read so far; rows before `start` are outside every window
        self.committed_rows = drafter.cache.rows

    @torch.inference_mode()
    def forward(self, tokens: Tensor, positions: Tensor | None = None, mask: Tensor | None = None) -> TargetOutput:
        """tokens [n]; without a mask: the next committed tokens (returns the last row's [1, vocab] logits); with
        one ([n, length + n] bool over slots) and positions [n]: tree nodes ([n, vocab])."""
        d, c, n, device = self.drafter, self.committed, tokens.numel(), tokens.device
        if mask is None:
            positions = torch.arange(self.length, self.length + n, device=device)
            out = d._run(tokens, positions, positions.clamp(max=c - 1), self.target_kv)[-1:]
            self.committed_rows = d.cache.rows
        else:
            assert positions is not None and mask.shape == (n, self.length + n), (tuple(mask.shape), n, self.length)
            mask, positions = mask.to(device), positions.to(device)
            node_rows = d.cache.rows - self.committed_rows
            slots = torch.cat([d.cache.positions[: self.committed_rows],
                               torch.arange(c, c + node_rows, device=device)])  # the slot of each cached row
            seen = mask[:, slots] & window_mask(positions, d.cache.positions, d.head.config.window)
            self_mask = torch.cat([seen, mask[:, self.length :]], 1)
            cross = torch.ones(n, self.target_kv[0].shape[1], dtype=torch.bool, device=device)
            past = (d.cache.keys, d.cache.values) if d.cache.rows else None
            out, k, v = d.head.step(tokens, positions, self_mask, past, self.target_kv, cross)
            d.cache.append(k, v, positions)
        self.length += n
        return TargetOutput(d.head.logits(out))

    def rewind(self, length: int) -> None:
        """Drop the tree nodes' rows (slots >= length >= c)."""
        assert length >= self.committed, (length, self.committed)
        self.drafter.cache.crop(self.committed_rows + length - self.committed)
        self.length = length
