"""The on-disk feature cache a head trains from: the target's hidden states and top-k labels per sequence.

A cache is a directory: `manifest.json` and shards `shard-00000.safetensors`, ... Shard s holds sequences
s * shard_size .. (s + 1) * shard_size - 1, each as four tensors `{i}.tokens` [n] int64, `{i}.hidden`
[n, fused_width] in the target's dtype, `{i}.label_ids` [n, k] int64 and `{i}.label_logprobs` [n, k] float32
(`sparrow.training.heads.Features`). The manifest names what made it: the target (name, shapes, dtype and a
fingerprint of its embedding and LM head weights), the layers read, k, and per shard a digest of its token
ids. A cache made by another target, other layers or another k is refused; a shard whose tokens differ from
the corpus now given is refused (the corpus changed); missing shards are extracted, so an interrupted
extraction resumes where it stopped and a larger corpus only adds shards.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from sparrow.errors import UserError
from sparrow.training.heads import DEFAULT_TOP_K, Features, features_of

MANIFEST = "manifest.json"
SHARD_SIZE = 16  # sequences per shard: the unit of resumption


@dataclass(frozen=True)
class CacheIdentity:
    """What a cache's features depend on; two caches with equal identities are interchangeable."""

    target: dict[str, Any]  # `target_identity` of the model
    layers: tuple[int, ...]  # transformers' hidden_states indices, concatenated in this order
    top_k: int


def target_identity(model: nn.Module, name: str) -> dict[str, Any]:
    """The target's name, shapes, dtype and a fingerprint of its embedding and LM head (two models with equal
    shapes but other weights differ)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    digest = hashlib.sha256()
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        weight = module.weight.detach()
        digest.update(weight[:4].float().cpu().numpy().tobytes())
        digest.update(weight[-4:].float().cpu().numpy().tobytes())
    weight = next(model.parameters())
    return {"name": name, "model_type": getattr(config, "model_type", ""), "hidden_size": config.hidden_size,
            "num_layers": config.num_hidden_layers, "vocab_size": model.get_output_embeddings().weight.shape[0],
            "dtype": str(weight.dtype).removeprefix("torch."), "weights": digest.hexdigest()[:16]}


def tokens_digest(sequences: Sequence[Tensor]) -> str:
    """A digest of the token ids of `sequences` (in order)."""
    digest = hashlib.sha256()
    for tokens in sequences:
        digest.update(tokens.to("cpu", torch.int64).numpy().tobytes())
        digest.update(b"|")
    return digest.hexdigest()[:16]


class FeatureCache:
    """A feature cache directory (see the module docstring) for one identity: `extract` fills it, the cache is
    then a sequence of `Features` read lazily from the shards (memory-mapped)."""

    def __init__(self, directory: str | Path, identity: CacheIdentity) -> None:
        self.directory = Path(directory)
        self.identity = identity
        self.shards: dict[int, dict[str, Any]] = {}  # shard index -> {"digest", "sequences", "tokens"}
        manifest = self.directory / MANIFEST
        if manifest.is_file():
            record = json.loads(manifest.read_text())
            stored = CacheIdentity(record["identity"]["target"], tuple(record["identity"]["layers"]),
                                   int(record["identity"]["top_k"]))
            if stored != identity:
                raise UserError(f"the feature cache {str(self.directory)!r} was made for {_describe(stored)}, "
                                f"not {_describe(identity)}: delete it or give another --features directory")
            self.shards = {int(s): v for s, v in record["shards"].items()}
        self._handles: dict[int, Any] = {}

    def extract(self, model: nn.Module, sequences: Sequence[Tensor],
                progress: Callable[[int, int], None] | None = None,
                should_stop: Callable[[], bool] | None = None) -> int:
        """Extract the features of `sequences` ([n] ids each, n >= 2) with `model` into the missing shards;
        returns how many sequences were computed (0: all cached). `progress(done, total)` is called per
        sequence; `should_stop()` is asked between shards (a time budget): the shards written so far stay."""
        self.directory.mkdir(parents=True, exist_ok=True)
        total, computed = len(sequences), 0
        for shard, start in enumerate(range(0, total, SHARD_SIZE)):
            chunk = sequences[start : start + SHARD_SIZE]
            digest = tokens_digest(chunk)
            stored = self.shards.get(shard)
            if stored is not None and int(stored["sequences"]) < len(chunk) and (
                    stored["digest"] == tokens_digest(chunk[: int(stored["sequences"])])):
                del self.shards[shard]  # a last shard the grown corpus now fills further: extract it again
            if shard in self.shards:
                if self.shards[shard]["digest"] != digest:
                    raise UserError(f"the feature cache {str(self.directory)!r} holds other token sequences in shard "
                                    f"{shard} than the corpus now given: the corpus changed (another --data, --tokens "
                                    "or tokenizer); delete the cache or give another --features directory")
                if progress is not None:
                    progress(start + len(chunk), total)
                continue
            if should_stop is not None and should_stop():
                break
            tensors: dict[str, Tensor] = {}
            for i, tokens in enumerate(chunk, start):
                f = features_of(model, self.identity.layers, tokens, self.identity.top_k)
                tensors.update({f"{i}.tokens": f.tokens, f"{i}.hidden": f.hidden, f"{i}.label_ids": f.label_ids,
                                f"{i}.label_logprobs": f.label_logprobs})
                computed += 1
                if progress is not None:
                    progress(i + 1, total)
            self._write_shard(shard, tensors, digest, len(chunk), sum(t.numel() for t in chunk))
        return computed

    def _write_shard(self, shard: int, tensors: dict[str, Tensor], digest: str, count: int, tokens: int) -> None:
        path = self.directory / _shard_name(shard)
        partial = path.with_suffix(".partial")
        save_file({k: t.detach().contiguous().cpu() for k, t in tensors.items()}, str(partial))
        os.replace(partial, path)  # a shard is either whole or absent
        self.shards[shard] = {"digest": digest, "sequences": count, "tokens": tokens}
        record = {"identity": asdict(self.identity), "shard_size": SHARD_SIZE,
                  "shards": {str(s): v for s, v in sorted(self.shards.items())}}
        manifest = self.directory / MANIFEST
        manifest.with_suffix(".partial").write_text(json.dumps(record, indent=1) + "\n")
        os.replace(manifest.with_suffix(".partial"), manifest)

    @property
    def tokens(self) -> int:
        """Positions cached (all shards)."""
        return sum(int(v["tokens"]) for v in self.shards.values())

    def complete(self, count: int) -> bool:
        """Whether the first `count` sequences are all extracted."""
        have = sum(int(v["sequences"]) for s, v in self.shards.items() if s * SHARD_SIZE < count)
        return have >= count and all(s in self.shards for s in range((count + SHARD_SIZE - 1) // SHARD_SIZE))

    def view(self, count: int, device: torch.device | str | None = None) -> CachedFeatures:
        """The first `count` sequences (all extracted), read lazily, moved to `device` when read."""
        if not self.complete(count):
            raise UserError(f"the feature cache {str(self.directory)!r} is incomplete: extract it first")
        return CachedFeatures(self, count, device)

    def read(self, i: int, device: torch.device | str | None = None) -> Features:
        shard = i // SHARD_SIZE
        if shard not in self._handles:
            self._handles[shard] = safe_open(str(self.directory / _shard_name(shard)), framework="pt")
        handle = self._handles[shard]
        tensors = [handle.get_tensor(f"{i}.{name}") for name in ("tokens", "hidden", "label_ids", "label_logprobs")]
        return Features(*(t.to(device) if device is not None else t for t in tensors))


class CachedFeatures(Sequence[Features]):
    """The first `count` sequences of a FeatureCache as a read-only sequence of Features."""

    def __init__(self, cache: FeatureCache, count: int, device: torch.device | str | None) -> None:
        self.cache, self.count, self.device = cache, count, device

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> Features:  # type: ignore[override]
        if not -self.count <= i < self.count:
            raise IndexError(i)
        return self.cache.read(i % self.count, self.device)

    def __iter__(self) -> Iterator[Features]:
        return (self[i] for i in range(self.count))


def _shard_name(shard: int) -> str:
    return f"shard-{shard:05d}.safetensors"


def _describe(identity: CacheIdentity) -> str:
    t = identity.target
    return (f"target {t.get('name')!r} ({t.get('model_type')}, hidden {t.get('hidden_size')}, "
            f"{t.get('num_layers')} layers, vocab {t.get('vocab_size')}, {t.get('dtype')}, weights "
            f"{t.get('weights')}), layers {list(identity.layers)}, top-{identity.top_k} labels")


__all__ = ["DEFAULT_TOP_K", "CacheIdentity", "CachedFeatures", "FeatureCache", "target_identity", "tokens_digest"]
