"""The reduced draft vocabulary: drafts score only the N most frequent target tokens (FR-Spec, Zhao et al.
ACL 2025, arXiv 2502.14856).

A draft's LM head costs vocab x d multiply-adds a token: 27 % of the 0.5B Qwen draft (151936 x 896), more for
Gemma-3-270M (262144 x 640). FR-Spec keeps the rows of the N most frequent tokens only. Here:

* `token_frequencies` counts the target tokenizer's ids over an offline corpus every machine has (`corpus_files`:
  about 4M characters of the Python standard library and of the installed packages' code, READMEs and docs),
  once per tokenizer and installation (cached under <sparrow cache>/draft_vocab).
* `top_tokens` keeps the N most frequent ids (ties: the lower id, which in a BPE vocabulary is the earlier,
  more frequent merge) and always the special and end-of-sequence tokens: a `DraftVocab`.
* `reduced_head_view(model, vocab)` is `model` with its LM head replaced by a `ReducedHead`: hidden @ W[ids]^T
  (N rows of the matmul), scattered into full-width logits that are -inf outside the set. Everything after the
  head (argmax / sampling, tree top-k, confidence exit, batched drafting) is unchanged and ids stay target ids.
  The view is a shallow copy sharing every other module and weight: the model itself is never modified, so a
  shared model (a draft that is elsewhere a target, the target a layer-skip drafter drafts with) stays as it is.

Lossless: the target verifies with its full vocabulary. A greedy draft is the argmax within the set; a sampled
draft's q is zero outside it, which the rejection rule handles exactly (min(1, p/q) at the drafted token, the
residual norm(max(p - q, 0)) keeps the target's mass on the excluded tokens). A token outside the set is never
drafted, only produced by the target (as the recovered or bonus token).
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import os
import pickle
import sysconfig
import weakref
from collections.abc import Iterable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from sparrow.errors import UserError
from sparrow.paths import default_cache_dir
from sparrow.runtime.gguf_linear import GGUFLinear
from sparrow.runtime.quant import DynamicInt8Linear, QuantizedLinear, kernel_takes

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from sparrow.models import LoadedModel

AUTO = "auto"
AUTO_MIN_VOCAB = 100_000  # draft_vocab="auto" reduces only vocabularies larger than this (Qwen2.5, Gemma-3, Llama-3)
AUTO_SIZE = 65_536  # ... to this many tokens. FR-Spec keeps 32k of Llama-3's 128k, counted on SlimPajama; with the
# local corpus 32k covered 95-98 % of Qwen2.5-Coder-1.5B's tokens on chat code answers and 64k 98-100 %
CORPUS_VERSION = 2  # bump when the corpus or the counting changes (the disk cache key includes it)
CORPUS_CHARS = 4_000_000  # characters of the default corpus (about 1M tokens; a few seconds to count)
FILE_CHARS = 32_768  # at most this much of each file, so the sample spans many files
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


def parse_draft_vocab(value: object, argument: str = "draft_vocab") -> int | str | None:
    """None / 0 (the full vocabulary), an integer N >= 1, or "auto" (a digit string counts as its integer)."""
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    if value is None or value == AUTO or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return value or None
    raise UserError(f"{argument} must be an integer >= 0 (0 = the full vocabulary) or 'auto', got {value!r}")


@dataclass(frozen=True, eq=False)
class DraftVocab:
    """The target ids a draft scores: the rows its reduced LM head keeps."""

    ids: Tensor  # [N] int64, sorted, unique, each in [0, vocab_size)
    vocab_size: int  # width of the full logits (the target's)

    def __post_init__(self) -> None:
        ids = self.ids
        if not isinstance(ids, Tensor) or ids.ndim != 1 or ids.dtype != torch.long or ids.numel() < 1:
            raise UserError(f"draft_vocab: ids must be a non-empty 1-D int64 tensor, got {ids!r}")
        if bool((ids[1:] <= ids[:-1]).any()) or int(ids[0]) < 0 or int(ids[-1]) >= self.vocab_size:
            raise UserError(f"draft_vocab: ids must be sorted, unique and in [0, {self.vocab_size})")

    def __len__(self) -> int:
        return self.ids.numel()

    @property
    def digest(self) -> str:
        """Identifies the set (reduced heads are built once per source head and digest)."""
        data = self.ids.cpu().numpy().tobytes() + self.vocab_size.to_bytes(8, "little")
        return hashlib.sha256(data).hexdigest()[:16]


# --- frequencies ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CorpusPart:
    """Files of one kind in one installed tree: a share of the default corpus."""

    tree: str  # a sysconfig path name: "stdlib" (the standard library), "purelib" (installed packages)
    suffixes: tuple[str, ...]  # file names ending in one of these
    share: float  # of the corpus' characters


CORPUS_PARTS = (
    CorpusPart("stdlib", (".py", ".md", ".rst", ".txt"), 0.5),  # Python code, English docstrings
    CorpusPart("purelib", (".md", ".rst", ".txt", "METADATA"), 0.25),  # prose and markdown: READMEs, docs
    CorpusPart("purelib", (".c", ".h", ".cpp", ".hpp", ".cu", ".js", ".ts", ".sh", ".toml", ".yaml", ".yml",
                           ".json", ".java", ".go", ".rs", ".html", ".css"), 0.25),  # other languages
)


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _sample(root: Path, suffixes: tuple[str, ...], max_chars: int) -> list[Path]:
    """Files under `root` (tests and nested site-packages left out), until about `max_chars` characters
    (FILE_CHARS per file). For variety, round-robin over the top-level entries (packages, modules): round i
    takes each entry's i-th file; entries and their files are ordered by the hash of their relative path."""
    groups: dict[str, list[Path]] = {}
    for directory, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
        for f in files:
            if f.endswith(suffixes):
                path = Path(directory, f)
                groups.setdefault(path.relative_to(root).parts[0], []).append(path)
    ordered = [sorted(groups[name], key=lambda path: _hash(path.relative_to(root).as_posix()))
               for name in sorted(groups, key=_hash)]
    found = [group[i] for i in range(max(map(len, ordered), default=0)) for group in ordered if i < len(group)]
    chosen, total = [], 0
    for path in found:
        if total >= max_chars:
            break
        with suppress(OSError):
            total += min(path.stat().st_size, FILE_CHARS)
            chosen.append(path)
    return chosen


def corpus_files(max_chars: int = CORPUS_CHARS) -> list[Path]:
    """The default corpus: a deterministic sample (for one installation) of the text files of the Python
    standard library and of the installed packages (CORPUS_PARTS), about `max_chars` characters."""
    paths = sysconfig.get_paths()
    chosen: list[Path] = []
    for part in CORPUS_PARTS:
        root = Path(paths[part.tree])
        if root.is_dir():
            chosen += [f for f in _sample(root, part.suffixes, int(part.share * max_chars)) if f not in chosen]
    return chosen


def _vocab_digest(tokenizer: PreTrainedTokenizerBase, vocab_size: int, files: Sequence[Path]) -> str:
    """Key of a frequency table: the tokenizer's vocabulary, the logit width, the corpus and its version."""
    h = hashlib.sha256(f"v{CORPUS_VERSION} {vocab_size} {FILE_CHARS}\n".encode())
    for token, i in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]):
        h.update(f"{i} {token}\n".encode("utf-8", "surrogatepass"))
    for path in files:
        with suppress(OSError):
            h.update(f"{path} {path.stat().st_size}\n".encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:24]


def _encode(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> Iterable[list[int]]:
    backend = getattr(tokenizer, "backend_tokenizer", None)  # fast tokenizers: no length warnings, batched
    if backend is not None:
        return (encoding.ids for encoding in backend.encode_batch(texts, add_special_tokens=False))
    return (tokenizer.encode(text, add_special_tokens=False) for text in texts)


def count_tokens(tokenizer: PreTrainedTokenizerBase, vocab_size: int, files: Sequence[Path]) -> Tensor:
    """[vocab_size] int64: how often each token id occurs in the first FILE_CHARS characters of each file."""
    texts = []
    for path in files:
        with suppress(OSError):
            texts.append(Path(path).read_text(encoding="utf-8", errors="replace")[:FILE_CHARS])
    ids = torch.tensor([i for encoded in _encode(tokenizer, texts) for i in encoded], dtype=torch.long)
    ids = ids[(ids >= 0) & (ids < vocab_size)]
    return torch.bincount(ids, minlength=vocab_size)


def token_frequencies(tokenizer: PreTrainedTokenizerBase, vocab_size: int, files: Sequence[Path] | None = None,
                      cache_dir: Path | str | None = None) -> Tensor:
    """[vocab_size] int64 token counts over `files` (default: `corpus_files()`), read from / written to
    <cache_dir>/draft_vocab/<digest>.pt (default cache: sparrow's, `SPARROW_CACHE`). An unreadable entry
    is counted again; an unwritable cache only costs the count next time."""
    files = corpus_files() if files is None else [Path(f) for f in files]
    directory = (Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()) / "draft_vocab"
    path = directory / f"{_vocab_digest(tokenizer, vocab_size, files)}.pt"
    with suppress(OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError):  # missing, damaged: count
        counts = torch.load(path, weights_only=True)
        if isinstance(counts, Tensor) and counts.shape == (vocab_size,) and counts.dtype == torch.long:
            return counts
    counts = count_tokens(tokenizer, vocab_size, files)
    with suppress(OSError):
        directory.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        torch.save(counts, partial)
        os.replace(partial, path)
    return counts


def always_kept(tokenizer: PreTrainedTokenizerBase, model: nn.Module | None, vocab_size: int) -> list[int]:
    """Ids every reduced vocabulary keeps: the tokenizer's special tokens and the model's end-of-sequence ids."""
    ids = set(getattr(tokenizer, "all_special_ids", ()))
    for config in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(config, "eos_token_id", None)
        ids.update(eos if isinstance(eos, (list, tuple)) else () if eos is None else (eos,))
    return sorted(i for i in ids if isinstance(i, int) and 0 <= i < vocab_size)


def top_tokens(counts: Tensor, n: int, always: Sequence[int] = ()) -> DraftVocab:
    """The `n` most frequent ids of `counts` ([vocab] int64; ties: the lower id), `always` included."""
    vocab_size = counts.numel()
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= vocab_size:
        raise UserError(f"draft_vocab must be an integer in [1, {vocab_size}] (the vocabulary's size), got {n!r}")
    keep = torch.tensor(sorted(set(always)), dtype=torch.long)
    if keep.numel() > n:
        raise UserError(f"draft_vocab {n} is smaller than the {keep.numel()} special tokens it always keeps")
    order = torch.sort(counts.cpu(), descending=True, stable=True).indices
    rest = order[~torch.isin(order, keep)][: n - keep.numel()]
    return DraftVocab(torch.cat([keep, rest]).sort().values, vocab_size)


def resolve_draft_vocab(option: int | str | DraftVocab | None, loaded: LoadedModel, vocab_size: int,
                        cache_dir: Path | str | None = None) -> DraftVocab | None:
    """The builders' `draft_vocab` option -> a DraftVocab, or None for the full vocabulary.

    option: None / 0 (full), N (the N most frequent tokens of `loaded`'s tokenizer), "auto" (AUTO_SIZE
    tokens for vocabularies over AUTO_MIN_VOCAB, else full), or a DraftVocab. vocab_size: the target's
    logit width."""
    if isinstance(option, DraftVocab):
        if option.vocab_size != vocab_size:
            raise UserError(f"draft_vocab is over a {option.vocab_size}-token vocabulary, the target has {vocab_size}")
        return option
    n = parse_draft_vocab(option)
    if n == AUTO:
        n = AUTO_SIZE if vocab_size > AUTO_MIN_VOCAB else None
    if n is None:
        return None
    if n > vocab_size:
        raise UserError(f"draft_vocab must be at most the vocabulary's size ({vocab_size}), got {n}")
    if n == vocab_size:
        return None  # every token: nothing to cut
    counts = token_frequencies(loaded.tokenizer, vocab_size, cache_dir=cache_dir)
    return top_tokens(counts, n, always_kept(loaded.tokenizer, loaded.model, vocab_size))


# --- the reduced head ----------------------------------------------------------------------------------

class ReducedHead(nn.Module):
    """An LM head scoring only `ids`: [..., d] hidden -> [..., vocab_size] logits, -inf outside `ids`."""

    def __init__(self, project: nn.Module, ids: Tensor, vocab_size: int, in_features: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.project = project  # [..., d] -> [..., N]: the source head's rows `ids`
        self.register_buffer("ids", ids, persistent=False)  # [N] int64
        self.vocab_size, self.in_features, self.weight_dtype = vocab_size, in_features, dtype  # the source head's

    @property
    def weight(self) -> Tensor:
        """A data-less [vocab_size, d] stand-in for code that reads the head's width (`CachedModel.vocab_size`)."""
        return torch.empty(self.vocab_size, self.in_features, dtype=self.weight_dtype, device="meta")

    def forward(self, hidden: Tensor) -> Tensor:
        reduced = self.project(hidden)  # [..., N]
        logits = reduced.new_full((*reduced.shape[:-1], self.vocab_size), float("-inf"))
        return logits.index_copy_(-1, self.ids, reduced)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, kept={self.ids.numel()} of {self.vocab_size}"


def _linear(weight: Tensor, bias: Tensor | None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
    return layer


def _project(head: nn.Module, ids: Tensor) -> nn.Module:
    """The rows `ids` of `head` as a layer of the same kind (a weight-only quantized head stays quantized)."""
    if isinstance(head, DynamicInt8Linear):  # the int8 rows and their scales: the same values
        bias = head.bias[ids] if head.bias is not None else None
        return DynamicInt8Linear(head.in_features, ids.numel(), head.int8_weight()[ids], head.scales[ids], bias,
                                 head.reduce_range)
    if isinstance(head, QuantizedLinear):
        if head.dense is None:
            raise UserError("draft_vocab: the draft's LM head is quantized without its dense weights; "
                            "quantize the draft with dense=LONG (as --draft-quant does)")
        bias = head.bias[ids] if head.bias is not None else None
        rows = _linear(head.dense[ids], bias)
        takes = kernel_takes(head.bits, ids.numel(), head.in_features, head.group_size, rows.weight.device)
        if not takes:
            return rows  # a row count the packed kernel does not take: these rows stay dense
        return QuantizedLinear.from_linear(rows, head.bits, head.group_size)  # per-row scales: the same values
    if isinstance(head, GGUFLinear):  # a head on GGUF blocks: the blocks of those rows (--draft-quant gguf)
        return head.rows(ids)
    if type(head) is nn.Linear:
        return _linear(head.weight[ids], head.bias[ids] if head.bias is not None else None)
    raise UserError(f"draft_vocab: the draft's LM head is a {type(head).__name__}; a reduced vocabulary needs "
                    "an nn.Linear (or sparrow's QuantizedLinear / DynamicInt8Linear / GGUFLinear) head")


_HEADS: weakref.WeakKeyDictionary[nn.Module, dict[str, ReducedHead]] = weakref.WeakKeyDictionary()


def reduced_head(head: nn.Module, vocab: DraftVocab) -> ReducedHead:
    """The ReducedHead of `head` for `vocab`, built once per (head, vocabulary) while `head` lives."""
    heads = _HEADS.setdefault(head, {})
    if vocab.digest not in heads:
        in_features = getattr(head, "in_features", None) or head.weight.shape[1]
        ids = vocab.ids.to(next(itertools.chain(head.parameters(), head.buffers())).device)
        with torch.no_grad():
            heads[vocab.digest] = ReducedHead(_project(head, ids), ids, vocab.vocab_size, in_features,
                                              head.weight.dtype)
    return heads[vocab.digest]


def _shallow(module: nn.Module) -> nn.Module:
    """A copy sharing parameters, buffers and config, with its own submodule table."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)  # copy.copy shares the dict: editing it would edit the original
    return clone


def reduced_head_view(model: nn.Module, vocab: DraftVocab) -> nn.Module:
    """`model` with its LM head scoring only `vocab.ids` (full-width logits, -inf elsewhere); shares every other
    module and weight, and changes nothing in `model`. Run it with `sparrow.runtime.runner.runner_for(view)`."""
    head = model.get_output_embeddings()
    name = next((n for n, m in model.named_modules() if m is head), None) if head is not None else None
    if not name:
        raise UserError(f"draft_vocab: {type(model).__name__} has no LM head module to reduce")
    if head.weight.shape[0] != vocab.vocab_size:
        raise UserError(f"draft_vocab is over a {vocab.vocab_size}-token vocabulary, the draft's LM head has "
                        f"{head.weight.shape[0]} rows")
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(config, "final_logit_softcapping", None) is not None:  # tanh(-inf) = -1: the set would leak
        raise UserError("draft_vocab: models with final logit soft-capping are not supported")
    path = name.split(".")
    root = parent = _shallow(model)
    for part in path[:-1]:
        parent._modules[part] = _shallow(parent._modules[part])
        parent = parent._modules[part]
    parent._modules[path[-1]] = reduced_head(head, vocab)
    return root


__all__ = ["AUTO", "DraftVocab", "ReducedHead", "always_kept", "corpus_files", "count_tokens", "parse_draft_vocab",
           "reduced_head", "reduced_head_view", "resolve_draft_vocab", "token_frequencies", "top_tokens"]
