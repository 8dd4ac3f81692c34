"""One reentrant lock per object a generation changes, taken in one global order.

A generation holds the locks of the target's module (its attention switch and capture hooks are shared by
every pipeline built on that model), the drafter, and every module the drafter declares it runs or changes
(`Drafter.modules`: a draft model, a head, the target itself for self-drafters). Taking them in one order (by
id) cannot deadlock; pipelines that share any of these objects run one after the other, and pipelines on
disjoint models run in parallel.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Iterator

import torch

from sparrow.drafters.base import Drafter

_LOCKS: dict[int, threading.RLock] = {}  # id(object) -> its lock, while the object lives
_LOCKS_GUARD = threading.Lock()


def stateful_objects(model: torch.nn.Module, drafter: Drafter | None) -> list[object]:
    """The objects a generation on `model` with `drafter` changes, in one global order (by id): the module,
    the drafter, and the modules it declares (`Drafter.modules`)."""
    found = {id(model): model}
    if drafter is not None:
        found.update((id(obj), obj) for obj in (drafter, *drafter.modules()))
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
