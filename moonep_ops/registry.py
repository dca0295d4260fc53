"""Names for the live objects the custom ops need: a bound backend, an expert pool.

A ``torch.library`` op can only take tensors, numbers and strings, and under
``torch.compile(fullgraph=True)`` a string is a compile-time constant.  So each op takes the
*name* of its group's backend (or pool) and looks it up here.  The registry holds weak
references only: a Buffer owns its backend and pools, and ``Buffer.destroy()`` (or dropping the
Buffer) ends their lives; a stale name then raises a clear error instead of reaching freed memory.
"""
from __future__ import annotations

import itertools
import weakref

_LIVE: "weakref.WeakValueDictionary[str, object]" = weakref.WeakValueDictionary()
_IDS = itertools.count()


def register(obj: object, kind: str) -> str:
    """Register ``obj`` under a fresh name ``moonep_<kind>_<n>`` and return the name."""
    name = f"moonep_{kind}_{next(_IDS)}"
    _LIVE[name] = obj
    return name


def unregister(name: str) -> None:
    _LIVE.pop(name, None)


def lookup(name: str, cls: type):
    """The live object registered under ``name``, which must be an instance of ``cls``."""
    obj = _LIVE.get(name)
    if obj is None:
        raise ValueError(f"no live moonep {cls.__name__} named {name!r} (its Buffer was destroyed "
                         "or never created)")
    if not isinstance(obj, cls):
        raise TypeError(f"{name!r} names a {type(obj).__name__}, not a {cls.__name__}")
    return obj


def live_count(kind: str) -> int:
    """How many objects of one kind are alive (tests of lifetimes)."""
    return sum(1 for n in list(_LIVE.keys()) if n.startswith(f"moonep_{kind}_"))
