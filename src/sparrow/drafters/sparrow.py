"""`--drafter eagle` with a Sparrow head (`sparrow.heads.sparrow_head`): drafting for Video-LLMs with no visual KV.

Like the EAGLE drafter, row t of the head reads the committed token x[t + 1] and the target's hidden states at
t (delivered at prefill and by `observe`), and predicts x[t + 2]; unlike it:
* positions whose token is a visual placeholder get no row (their features are dropped on arrival), so the
  head's cache never holds visual KV, whatever the number of frames;
* each row attends to the last `text_window` text rows only, and after every round the cache is trimmed back to
  them: the draft's cost per token is bounded by the window, not by the context or the video.
Each round runs the pending text rows (committed tokens), drafts a chain from the last one (a draft row reads its
parent's output) or an EAGLE-2 tree (`dynamic_tree` drives `TreeRunner`: a node's row reads its parent's output
and sees the window's committed rows and its ancestors), then drops the draft rows (accepted tokens are re-read
with the target's features next round).
"""

from __future__ import annotations

import torch
from torch import Tensor

from sparrow.config import SamplingConfig
from sparrow.drafters.base import DrafterBase
from sparrow.drafters.draft_loop import draft_chain, drive
from sparrow.drafters.tree_draft import TreeShape, dynamic_tree
from sparrow.errors import UserError
from sparrow.heads.eagle import EagleHead, HeadCache
from sparrow.heads.longspec import window_mask
from sparrow.heads.sparrow_head import spec_of
from sparrow.noise import Randomness
from sparrow.policy.length import LengthPolicy
from sparrow.runtime.cached_model import CachedModel
from sparrow.types import Draft, Prompt, StepStats, TargetOutput, Verdict


class SparrowDrafter(DrafterBase):
    name = "eagle"

    def __init__(self, head: EagleHead, visual_ids: tuple[int, ...], num_draft_tokens: int = 6,
                 adaptive: bool = False, tree: TreeShape | None = None) -> None:
        spec = spec_of(head)
        assert spec is not None, "SparrowDrafter needs a Sparrow head"
        self.head, self.window, self.tree = head, spec.text_window, tree
        self.name = "eagle+tree" if tree is not None else "eagle"
        self.hidden_layers: tuple[int, ...] = head.config.target_layers
        self.visual_ids = torch.tensor(visual_ids, dtype=torch.long, device=head.fc.weight.device)
        self.length = LengthPolicy(num_draft_tokens, adaptive=adaptive, backoff=adaptive)
        self.rows_seen = 0  # text rows ever run (for tests: the FLOP proxy is rows x attended keys)
        self.keys_attended = 0  # sum over rows of the keys each row attended to
        self.reset()

    def reset(self) -> None:
        self.cache: HeadCache = self.head.empty_cache()
        self.positions = torch.zeros(0, dtype=torch.long, device=self.head.fc.weight.device)  # [rows]
        self.fed = 0  # positions whose features arrived
        self.pending = self.head.fc.weight.new_zeros(0, self.head.config.fused_width)  # text rows not yet run
        self.pending_positions = torch.zeros_like(self.positions)

    def _add(self, hidden: Tensor, text: Tensor) -> None:
        """hidden [layers, m, D] of positions fed .. fed + m; `text` [m] bool: the text positions (kept)."""
        m = hidden.shape[1]
        assert text.shape == (m,), (tuple(text.shape), m)
        text = text.to(self.pending.device)
        rows = hidden.permute(1, 0, 2).reshape(m, -1).to(self.pending)[text]
        self.pending = torch.cat([self.pending, rows])
        self.pending_positions = torch.cat([self.pending_positions,
                                            torch.arange(self.fed, self.fed + m, device=text.device)[text]])
        self.fed += m

    def modules(self) -> tuple[torch.nn.Module, ...]:
        return (self.head,)

    def prefill(self, prompt: Prompt, target: CachedModel | None = None, out: TargetOutput | None = None) -> None:
        if out is None or out.hidden is None:
            raise UserError("the Sparrow head needs the target's hidden states at prefill (run it through the engine)")
        self.reset()
        self.length.reset()
        n = prompt.input_ids.numel()
        self._add(out.hidden[:, -n:], ~torch.isin(prompt.input_ids.to(self.visual_ids.device), self.visual_ids))

    def _run(self, tokens: Tensor, hidden: Tensor, positions: Tensor) -> Tensor:
        rows = self.cache.rows
        ranks = torch.arange(rows + tokens.numel(), device=positions.device)
        mask = window_mask(ranks[rows:], ranks, self.window)
        self.rows_seen += tokens.numel()
        self.keys_attended += int(mask.sum())
        out = self.head.run(tokens, hidden, positions, mask, self.cache)
        self.positions = torch.cat([self.positions, positions])
        return out

    def _keep_last(self, rows: int) -> None:
        """Keep the last `rows` rows of the cache (copies into a fresh cache: its size stays bounded)."""
        first = max(self.cache.rows - rows, 0)
        past, outputs = self.cache.past, self.cache.hidden
        self.cache = self.head.empty_cache()
        if past is not None and first < outputs.shape[0]:
            self.cache.append(past[0][:, first:], past[1][:, first:], outputs[first:])
        self.positions = self.positions[first:].clone()

    @torch.inference_mode()
    def propose(self, committed: Tensor, max_tokens: int, sampling: SamplingConfig, generator: Randomness) -> Draft:
        device = self.head.fc.weight.device
        committed = committed.to(device)
        c = committed.numel()
        assert self.fed == c - 1, (self.fed, c)
        num_tokens = self.length.cap(max_tokens)
        # the first draft token comes from the row of position c - 2, which must be a text row
        last_is_text = bool(self.pending_positions.numel()) and int(self.pending_positions[-1]) == c - 2
        if num_tokens < 1 or not (last_is_text or (self.positions.numel() and int(self.positions[-1]) == c - 2)):
            return Draft.empty(device)
        pending, positions = self.pending[-self.window:], self.pending_positions[-self.window:]
        self.pending, self.pending_positions = self.pending[:0], self.pending_positions[:0]
        committed_rows = self.cache.rows + positions.numel()

        def run_committed() -> Tensor:
            """The pending text rows; [1, d] the output of the last row (position c - 2)."""
            if positions.numel():
                return self._run(committed[positions + 1], self.head.fuse(pending), positions)[-1:]
            return self.cache.hidden[-1:]

        if self.tree is not None:
            runner = TreeRunner(self, c, run_committed)
            draft, _ = dynamic_tree(runner, committed, self.tree, num_tokens, sampling)
            runner.rewind(c)
            self._keep_last(self.window)
            return draft

        def answer(request: tuple[Tensor, int]) -> Tensor:
            token, i = request
            if i == 0:
                out = run_committed()
            else:
                position = torch.full((1,), c - 2 + i, device=device)
                out = self._run(token, self.cache.hidden[-1:], position)
            return self.head.logits(out[-1:])[-1]

        draft = drive(draft_chain(lambda token, i: (token, i), committed[-1:], num_tokens, sampling, generator,
                                  self.length), answer)
        self.cache.crop(committed_rows)  # drop the draft rows
        self.positions = self.positions[:committed_rows]
        self._keep_last(self.window)
        return draft

    def observe(self, draft: Draft, verdict: Verdict, out: TargetOutput | None = None,
                step: StepStats | None = None) -> None:
        assert out is not None and out.hidden is not None, "the Sparrow head needs the target's hidden states"
        # generated positions are text, even where a random model emits a placeholder id (it has no pixels)
        self._add(out.hidden, torch.ones(out.hidden.shape[1], dtype=torch.bool))
        self.length.observe(step)


class TreeRunner:
    """The Sparrow head as the CachedModel-like object `dynamic_tree` drives, over token slots: the first forward
    (the last committed token) runs the pending text rows; tree nodes take slots c, c + 1, .. and each node's row
    reads its parent's output (the last committed row for the root's children) under the tree's mask."""

    def __init__(self, drafter: SparrowDrafter, committed: int, run_committed) -> None:
        self.drafter, self.committed, self.run_committed = drafter, committed, run_committed
        self.length = committed - 1  # dynamic_tree feeds committed[length:], the last token, first
        self.committed_rows = drafter.cache.rows

    @torch.inference_mode()
    def forward(self, tokens: Tensor, positions: Tensor | None = None, mask: Tensor | None = None) -> TargetOutput:
        d, c, n = self.drafter, self.committed, tokens.numel()
        if mask is None:
            assert n == 1 and self.length == c - 1, (n, self.length, c)
            out = self.run_committed()
            d._keep_last(d.window)  # the window of committed rows the nodes see
            self.committed_rows, self.length = d.cache.rows, c
            return TargetOutput(d.head.logits(out))
        assert positions is not None and mask.shape == (n, self.length + n), (tuple(mask.shape), n, self.length)
        device = d.head.fc.weight.device
        mask, fed = mask.to(device), self.length - c
        nodes_seen = mask[:, c : self.length]  # [n, fed] earlier nodes: the ancestors
        latest = torch.where(nodes_seen, torch.arange(fed, device=device), -1).max(1).values if fed else \
            torch.full((n,), -1, device=device)
        parent_rows = torch.where(latest >= 0, self.committed_rows + latest, self.committed_rows - 1)
        row_mask = torch.cat([mask.new_ones(n, self.committed_rows), nodes_seen, mask[:, self.length :]], 1)
        d.rows_seen += n
        d.keys_attended += int(row_mask.sum())
        out = d.head.run(tokens.to(device), d.cache.hidden[parent_rows], positions.to(device) - 1, row_mask, d.cache)
        d.positions = torch.cat([d.positions, positions.to(device) - 1])
        self.length += n
        return TargetOutput(d.head.logits(out))

    def rewind(self, length: int) -> None:
        """Drop the tree nodes' rows (slots >= length >= c)."""
        assert length >= self.committed, (length, self.committed)
        rows = self.committed_rows + length - self.committed
        self.drafter.cache.crop(rows)
        self.drafter.positions = self.drafter.positions[:rows]
        self.length = length
