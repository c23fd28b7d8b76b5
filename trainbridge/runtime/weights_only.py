"""What ``torch.load(weights_only=True)`` reads back, checked before a file is written.

Every file trainbridge writes for itself to read later (checkpoints, ``hvd.elastic``'s
commit file) is read with ``weights_only=True``; a value that loader refuses is named
when the file is written, not when a resume fails.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..errors import first_line

# What torch.load(weights_only=True) reads back besides tensors and the containers below.
PLAIN_TYPES = (int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device, torch.Size)


def _loadable_globals() -> set:
    try:
        from torch._weights_only_unpickler import _get_allowed_globals

        allowed = set(_get_allowed_globals())
    except (ImportError, AttributeError):  # another torch: trust torch.save's own checks
        return set()
    # Entries given as (function, name) pairs are left out.
    return allowed | {
        f"{g.__module__}.{g.__qualname__}"
        for g in torch.serialization.get_safe_globals()
        if not isinstance(g, tuple) and hasattr(g, "__qualname__")
    }


def unloadable_value(obj: Any, where: str = "") -> Optional[str]:
    """Where ``obj`` holds a value that ``torch.load(weights_only=True)`` refuses, and what it is; None if nowhere.

    A file holding one could be written but never read back (a numpy scalar, an
    ``argparse.Namespace``, a named tuple, a ``pathlib.Path``, a function).
    """
    allowed = _loadable_globals()
    if not allowed:
        return None
    stack = [(where, obj)]
    while stack:
        path, value = stack.pop()
        if type(value) in PLAIN_TYPES or isinstance(value, torch.Tensor):  # exact: numpy.float64 is a float too
            continue
        kind = type(value)
        if kind in (dict, list, tuple, set, frozenset) or f"{kind.__module__}.{kind.__qualname__}" in allowed:
            if isinstance(value, dict):
                stack += [(f"{path}[{k!r}]", v) for k, v in value.items()] + [(f"{path} key", k) for k in value]
            elif isinstance(value, (list, tuple, set, frozenset)):
                stack += [(f"{path}[{i}]", v) for i, v in enumerate(value)]
            continue
        return f"{path or 'the object'} holds a {kind.__module__}.{kind.__qualname__} ({first_line(repr(value), 60)})"
    return None
