"""``torch.compile`` before or after ``job.prepare``: the job sees through the compiled wrapper.

``torch.compile(module)`` returns an ``OptimizedModule`` that holds the module as
``_orig_mod``, so its state_dict keys start with ``_orig_mod.`` and it is not the
object ``prepare`` returned. :meth:`Job.unwrap`, :meth:`Job.no_sync`,
:meth:`Job.save` and :meth:`Job.load` take a model compiled before or after
``prepare`` (or a module with compiled submodules) as the model itself: checkpoints
hold the keys of the uncompiled model, and load into a compiled or an uncompiled one.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from typing import Any, Callable, Dict, Mapping

import torch

COMPILED_PART = "_orig_mod"  # the attribute, and the key segment, of the module inside an OptimizedModule


def uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` without the ``torch.compile`` wrappers around it (the same object when there are none)."""
    # torch.compile imports dynamo; before that nothing is compiled (and importing it here would cost a second).
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    while dynamo is not None and isinstance(model, dynamo.OptimizedModule):
        model = model._orig_mod
    return model


def uncompiled_key(key: str) -> str:
    """A state_dict key (or a module's name) as the uncompiled model has it: without ``_orig_mod`` segments."""
    if COMPILED_PART not in key:
        return key
    return ".".join(part for part in key.split(".") if part != COMPILED_PART)


def _renamed(state: Mapping[str, Any], rename: Callable[[str], str]) -> Mapping[str, Any]:
    """``state`` with its keys, and the module names of its ``_metadata`` (``load_state_dict`` reads), renamed."""
    out: Dict[str, Any] = OrderedDict((rename(k), v) for k, v in state.items())
    metadata = getattr(state, "_metadata", None)
    if metadata is not None:
        out._metadata = OrderedDict((rename(k), v) for k, v in metadata.items())  # type: ignore[attr-defined]
    return out


def without_compiled_keys(state: Mapping[str, Any]) -> Mapping[str, Any]:
    """A module's ``state_dict()`` with the keys of the uncompiled module (``state`` itself when they are already)."""
    if not any(COMPILED_PART in k for k in state):
        return state
    return _renamed(state, uncompiled_key)


def keys_as_in(state: Mapping[str, Any], module: torch.nn.Module) -> Mapping[str, Any]:
    """``state`` (a saved state_dict, compiled keys or not) with the keys that ``module`` (compiled or not) has."""
    # Module names too: the metadata is keyed by them (the compiled root is "", the module inside it "_orig_mod").
    names = [name for name, _ in module.named_modules()] + list(module.state_dict(keep_vars=True))
    wanted = {uncompiled_key(name): name for name in names}
    if all(wanted.get(uncompiled_key(k), k) == k for k in state):
        return state
    return _renamed(state, lambda k: wanted.get(uncompiled_key(k), k))
