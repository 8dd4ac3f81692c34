"""One reentrant lock per object a generation changes, taken in one global order.

A generation holds the locks of the target's module (its attention switch and capture hooks are shared by
every pipeline built on that model), the drafter, and every module the drafter runs (a draft model, the
target itself for self-drafters). Taking them in one order (by id) cannot deadlock; pipelines that share
any of these objects run one after the other, and pipelines on disjoint models run in parallel.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping

import torch

from sparrow.drafters.base import Drafter

_LOCKS: dict[int, threading.RLock] = {}  # id(object) -> its lock, while the object lives
_LOCKS_GUARD = threading.Lock()
_WALK_DEPTH = 4  # attribute hops from a drafter to the modules it runs (drafter -> runner -> module: 2)
_WALK_WIDTH = 64  # longer containers hold data (token lists), not models


def stateful_objects(model: torch.nn.Module, drafter: Drafter | None) -> list[object]:
    """The objects a generation on `model` with `drafter` changes, in one global order (by id): the module,
    the drafter, and every module reachable from the drafter through sparrow's own objects and containers."""
    found = {id(model): model}
    if drafter is not None:
        seen: set[int] = set()
        stack: list[tuple[object, int]] = [(drafter, 0)]
        while stack:
            obj, depth = stack.pop()
            if id(obj) in seen or depth > _WALK_DEPTH:
                continue
            seen.add(id(obj))
            if isinstance(obj, torch.nn.Module):
                found[id(obj)] = obj
                continue  # its submodules are part of it
            if obj is drafter:
                found[id(obj)] = obj
                children = list(vars(obj).values()) if hasattr(obj, "__dict__") else []
            elif isinstance(obj, Mapping):
                children = list(obj.values())
            elif isinstance(obj, (list, tuple, set, frozenset)):
                children = list(obj)
            elif type(obj).__module__.startswith("sparrow.") and hasattr(obj, "__dict__"):
                children = list(vars(obj).values())
            else:
                continue
            if len(children) <= _WALK_WIDTH:
                stack.extend((child, depth + 1) for child in children)
    return [found[key] for key in sorted(found)]


def lock_for(obj: object) -> threading.RLock:
    """The one lock of `obj` (reentrant: a thread may run a nested generation on the same models)."""
    key = id(obj)
    with _LOCKS_GUARD:
        lock = _LOCKS.get(key)
        if lock is None:
            lock = _LOCKS[key] = threading.RLock()
            try:  # forget it with the object, before its id can be reused
                weakref.finalize(obj, _LOCKS.pop, key, None)
            except TypeError:  # not weak-referenceable: the lock stays (an id reused later only shares it)
                pass
    return lock


@contextlib.contextmanager
def holding(objects: Iterable[object]) -> Iterator[None]:
    """Hold the lock of each of `objects` (already in stateful_objects' order) for the block."""
    with contextlib.ExitStack() as stack:
        for obj in objects:
            stack.enter_context(lock_for(obj))
        yield
