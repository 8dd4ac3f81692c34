"""Seeded randomness keyed by absolute token position, so a seeded run repeats however it was chunked.

A sequential `torch.Generator` hands out random numbers in call order, so a seeded speculative run
repeats only if every round drafts the same number of tokens; the adaptive length policy follows
measured timings, so it does not. Here the randomness of position t is a fresh generator seeded from
(seed, t): the exponentials E_t [vocab] of the exponential race (`sampling.sample`).

Coupled verification (Gumbel-max coupling; Daliri, Musco & Suresh 2024, "Coupling without
communication and drafter-invariant speculative decoding"): the token committed at position t is the
target's own sample argmax(p_t / E_t); a draft node is accepted when its token equals that sample at
its parent's row, i.e. greedy matching against the target's seeded sample. Then
* lossless: E_t is independent of everything before t, so each committed token is an exact sample
  of p given the committed prefix, whatever was drafted;
* chunk-invariant: the token at t depends only on the committed prefix and E_t, not on draft lengths,
  back-off, tree shapes or the drafter, so a seeded run equals seeded plain decoding (`baseline`);
* sampled drafts use the same E_t (argmax(q_t / E_t)), which makes them likely to equal the target's
  sample: P(accept) = sum_i 1 / sum_j max(p_j / p_i, q_j / q_i) >= (1 - TV) / (1 + TV),
  slightly below the 1 - TV of min(1, p/q) rejection sampling, which cannot be chunk-invariant (a
  bonus position has no draft, so its token cannot depend on q). Deterministic drafts (argmax,
  n-gram, top-k tree children) are accepted with probability p(x) (sum over siblings), as by the
  q = 1 rule.

Unseeded runs keep the sequential `torch.Generator` (or None) and rejection sampling.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor


def generator_for(seed: int, position: int, device: torch.device | str) -> torch.Generator:
    """A fresh generator on `device` seeded from a hash of (seed, position) (blake2b, 64 bits)."""
    key = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(key, "little"))


MAX_KEPT = 32
"""Positions whose draws a request keeps (32 x vocab floats: 19 MB at a 152k vocabulary); drafts longer than
this only redraw noise, with the same values."""


@dataclass(frozen=True)
class PositionalNoise:
    """The randomness of a seeded request; `start` is the absolute position of offset 0.

    The views made by `at` share one cache of drawn exponentials, so a position's noise is drawn once, however
    often the draft and the verifier read it: about one [vocab] draw per generated token, as in plain decoding.
    Positions are read in increasing order, so the cache keeps the MAX_KEPT latest and drops the earliest."""

    seed: int
    device: torch.device
    start: int = 0
    drawn: dict[tuple[int, int, torch.dtype], Tensor] = field(default_factory=dict, compare=False, repr=False)

    def at(self, offset: int) -> PositionalNoise:
        """The same noise seen from `offset` positions later (a round's first draft position, say)."""
        return replace(self, start=self.start + offset)

    def exponentials(self, offsets: list[int], vocab: int, like: Tensor) -> Tensor:
        """[len(offsets), vocab] Exp(1) draws of positions start + offsets, with the dtype and device of `like`."""
        rows = []
        for position in (self.start + i for i in offsets):
            key = (position, vocab, like.dtype)
            if key not in self.drawn:
                generator = generator_for(self.seed, position, self.device)
                u = torch.rand(vocab, dtype=torch.float64, device=self.device, generator=generator)
                self.drawn[key] = torch.log1p(-u).neg_().to(like.dtype)  # inverse CDF: faster than exponential_ on CPUs
            rows.append(self.drawn[key])
        while len(self.drawn) > MAX_KEPT:
            del self.drawn[min(self.drawn, key=lambda key: key[0])]
        return torch.stack(rows).to(like.device)


Randomness = torch.Generator | PositionalNoise | None
"""What the sampling code takes: a sequential generator, positional noise (seeded requests), or None."""


def at(randomness: Randomness, offset: int) -> Randomness:
    """Positional noise shifted by `offset`; a sequential generator (or None) unchanged."""
    return randomness.at(offset) if isinstance(randomness, PositionalNoise) else randomness
