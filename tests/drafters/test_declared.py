"""What every drafter declares about itself, checked against its object graph: `Drafter.modules` names every
torch module it can reach (the locks of `sparrow.locks` cover exactly those), and `Drafter.fork` shares those
modules, their configs, tokenizers and what `shared()` names, while every other piece of state it reaches is
its own; a forked generation gives the original's output. The walker below is the oracle, not the house's way:
drafters are asked, never walked.

Every registered drafter has cases here (tiny random models, float32): a new drafter joins by adding one."""

from __future__ import annotations

import enum
import types
from collections.abc import Callable, Iterator

import pytest
import torch
from conftest import perturbed, tiny_model, tiny_tokenizer
from transformers import GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase, ProcessorMixin
from vlm_models import byte_tokenizer, moving_squares, tiny_processor, tiny_vlm

from sparrow.drafters import REGISTRY, build_drafter
from sparrow.drafters.auto import AutoDrafter
from sparrow.drafters.base import Drafter
from sparrow.heads.factory import new_head
from sparrow.locks import stateful_objects
from sparrow.models import LoadedModel
from sparrow.pipeline import Pipeline
from sparrow.vision.video import Video

pytestmark = pytest.mark.usefixtures("one_thread")

LEAVES = (torch.nn.Module, PretrainedConfig, GenerationConfig, PreTrainedTokenizerBase, ProcessorMixin)
"""What the oracle does not walk into: models (their submodules are part of them), configs, tokenizers."""
SKIP = {"num_layers": 2, "mlp": [1]}  # tiny models ship no tuned layer-skip set
TREE = {"tree_budget": 4, "tree_topk": 2, "tree_depth": 3}
TOKENS = 12


def children(obj: object) -> Iterator[object]:
    """What `obj` refers to: items of containers, attributes, a bound method's object, a closure's cells."""
    if isinstance(obj, LEAVES) or isinstance(obj, (type, types.ModuleType, enum.Enum)):
        return
    if isinstance(obj, dict):
        yield from obj.keys()
        yield from obj.values()
    elif isinstance(obj, (list, tuple, set, frozenset)):
        yield from obj
    elif isinstance(obj, types.MethodType):
        yield obj.__self__
    elif isinstance(obj, types.FunctionType):
        yield from (cell.cell_contents for cell in obj.__closure__ or ())
    elif isinstance(getattr(obj, "__dict__", None), dict):
        yield from vars(obj).values()


def reachable(root: object, stop: dict[int, object] | None = None) -> dict[int, object]:
    """Every object reachable from `root` (by id), not walking past LEAVES nor past `stop`."""
    found: dict[int, object] = {}
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in found:
            continue
        found[id(obj)] = obj
        if stop is None or id(obj) not in stop:
            stack.extend(children(obj))
    return found


def stateful(obj: object) -> bool:
    """Objects a fork must own unless declared shared (mutable containers, tensors, instances with attributes)."""
    if isinstance(obj, (types.FunctionType, types.BuiltinFunctionType, type, types.ModuleType, enum.Enum)):
        return False
    return isinstance(obj, (list, dict, set, bytearray, torch.Tensor)) or hasattr(obj, "__dict__")


def modules_of(obj: object, stop: dict[int, object] | None = None) -> dict[int, torch.nn.Module]:
    return {k: v for k, v in reachable(obj, stop).items() if isinstance(v, torch.nn.Module)}


# --- cases ----------------------------------------------------------------------------------------------------


def text_models(tokenizer) -> dict[str, LoadedModel]:
    target = LoadedModel(tiny_model("llama", seed=0), tokenizer, "tiny")
    other_tok = tiny_tokenizer(vocab_size=300, eos="</s>")  # another model family's tokenizer
    return {"target": target, "close": LoadedModel(perturbed(target.model, 0.05, seed=1), tokenizer, "close"),
            "other": LoadedModel(tiny_model("qwen2", seed=1, vocab_size=300), other_tok, "other")}


def vlm_models() -> dict[str, LoadedModel]:
    tok = byte_tokenizer()
    model = tiny_vlm("qwen2.5-vl", tok, seed=0)
    processor = tiny_processor("qwen2.5-vl", tok)
    return {"target": LoadedModel(model, tok, "qwen2.5-vl", processor),
            "close": LoadedModel(perturbed(model, 0.05, seed=1), tok, "close", processor)}


def _head(arch: str, **options) -> Callable[[dict[str, LoadedModel]], Drafter]:
    def build(m: dict[str, LoadedModel]) -> Drafter:
        head = new_head(m["target"].model, arch, torch.Generator().manual_seed(0), **options)
        return build_drafter("eagle", m["target"], None, 3, head=head)
    return build


def _self_drafting_auto(m: dict[str, LoadedModel]) -> Drafter:
    """Auto over candidates the registry's auto cannot pick on a tiny model (no tuned skip set, no shipped head)."""
    t = m["target"]
    names = [("prompt-lookup", {}), ("layer-skip", {"skip_set": SKIP}), ("sparse", {}), ("suffix", {}),
             ("cross-vocab", {})]
    candidates = [build_drafter(n, t, m["other"] if n == "cross-vocab" else None, 3, **o) for n, o in names]
    return AutoDrafter([*candidates, _head("eagle3")(m)])


CASES: dict[str, tuple[str, bool, Callable[[dict[str, LoadedModel]], Drafter]]] = {
    # case: (registered drafter, on the VLM, builder)
    "draft-model": ("draft-model", False, lambda m: build_drafter("draft-model", m["target"], m["close"], 3)),
    "draft-model+vocab+tree": ("draft-model", False, lambda m: build_drafter(
        "draft-model", m["target"], m["close"], 3, draft_vocab=64, **TREE)),
    "draft-model+draft-kv": ("draft-model", True, lambda m: build_drafter(
        "draft-model", m["target"], m["close"], 3, draft_kv="hybridkv", draft_kv_budget=8, retrieve_every=2)),
    "prompt-lookup": ("prompt-lookup", False, lambda m: build_drafter("prompt-lookup", m["target"], None, 3)),
    "suffix+tree": ("suffix", False, lambda m: build_drafter("suffix", m["target"], None, 3, **TREE)),
    "quantized-self": ("quantized-self", False, lambda m: build_drafter("quantized-self", m["target"], None, 3)),
    "cross-vocab": ("cross-vocab", False, lambda m: build_drafter("cross-vocab", m["target"], m["other"], 3)),
    "auto": ("auto", False, lambda m: build_drafter("auto", m["target"], m["close"], 3, quantized_self=True,
                                                    **TREE)),
    "auto+self-drafters": ("auto", False, _self_drafting_auto),
    "sparse": ("sparse", False, lambda m: build_drafter("sparse", m["target"], None, 3)),
    "visual-prune": ("visual-prune", True, lambda m: build_drafter("visual-prune", m["target"], None, 3)),
    "visual-prune+draft+draft-kv": ("visual-prune", True, lambda m: build_drafter(
        "visual-prune", m["target"], m["close"], 3, draft_kv="hybridkv", draft_kv_budget=8, retrieve_every=2)),
    "layer-skip": ("layer-skip", False, lambda m: build_drafter("layer-skip", m["target"], None, 3, skip_set=SKIP)),
    "layer-skip+vocab+tree": ("layer-skip", False, lambda m: build_drafter(
        "layer-skip", m["target"], None, 3, skip_set=SKIP, draft_vocab=64, **TREE)),
    "eagle": ("eagle", False, _head("eagle3")),
    "eagle+eagle1+tree": ("eagle", False, lambda m: build_drafter(
        "eagle", m["target"], None, 3, head=new_head(m["target"].model, "eagle1", torch.Generator().manual_seed(0)),
        **TREE)),
    "eagle+longspec": ("eagle", False, _head("longspec", window=16)),
    "eagle+sparrow": ("eagle", True, _head("sparrow", text_window=16)),
}


@pytest.fixture(scope="module")
def models(tokenizer) -> dict[bool, dict[str, LoadedModel]]:
    return {False: text_models(tokenizer), True: vlm_models()}


def test_every_registered_drafter_has_a_case():
    assert set(REGISTRY) <= {drafter for drafter, _, _ in CASES.values()}


@pytest.mark.parametrize("case", list(CASES))
def test_modules_are_declared_and_forks_share_exactly_what_is_declared(models, case):
    _, vlm, build = CASES[case]
    m = models[vlm]
    target = m["target"]
    media = {"video": Video.from_array(moving_squares(4)), "frames": 4} if vlm else {}
    prompt = "What moves? The quick brown fox" if vlm else "The quick brown fox jumps. The quick brown fox"
    drafter = build(m)
    declared = drafter.modules()
    assert all(isinstance(module, torch.nn.Module) for module in declared)
    assert len({id(module) for module in declared}) == len(declared), "modules() repeats a module"

    # a) every module it reaches is declared (before a generation, and after one: then its prefill's target too)
    def undeclared(allowed: tuple[torch.nn.Module, ...]) -> list[str]:
        ids = {id(module) for module in allowed}
        return sorted(type(v).__name__ for k, v in modules_of(drafter).items() if k not in ids)

    assert undeclared(declared) == [], f"{case}: modules() misses what it reaches"
    pipe = Pipeline(target, drafter)
    plain = pipe.generate_plain(prompt, max_new_tokens=TOKENS, **media).token_ids
    first = pipe.generate(prompt, max_new_tokens=TOKENS, **media)
    assert first.token_ids == plain
    assert undeclared((*declared, target.model)) == [], f"{case}: modules() misses what it reaches"
    assert [id(module) for module in drafter.modules()] == [id(module) for module in declared]
    locked = {id(obj) for obj in stateful_objects(target.model, drafter)}
    assert locked == {id(target.model), id(drafter), *map(id, declared)}

    # b) a fork after that generation: the same modules, configs and tokenizers, and its own state otherwise
    fork = drafter.fork()
    assert type(fork) is type(drafter) and fork is not drafter
    assert [id(module) for module in fork.modules()] == [id(module) for module in declared]
    original = reachable(drafter)
    copied = [type(v).__name__ for k, v in reachable(fork).items() if isinstance(v, LEAVES) and k not in original]
    assert copied == [], f"{case}: the fork copied {copied}"
    allowed = {id(obj): obj for obj in (*declared, target.model, *drafter.shared())}
    owned = reachable(fork, stop=allowed)
    both = sorted(type(v).__name__ for k, v in owned.items()
                  if k in original and k not in allowed and stateful(v) and not isinstance(v, LEAVES))
    assert both == [], f"{case}: the fork shares undeclared state {both}"

    # c) a generation with the fork gives the original's output, and leaves the original's state alone
    forked = Pipeline(target, fork).generate(prompt, max_new_tokens=TOKENS, **media)
    assert forked.token_ids == first.token_ids
    assert pipe.generate(prompt, max_new_tokens=TOKENS, **media).token_ids == plain
