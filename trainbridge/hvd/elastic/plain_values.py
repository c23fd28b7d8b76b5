"""Elastic state as values that ``torch.load(weights_only=True)`` reads back, and back again.

Horovod keeps a commit in memory, so any Python value works. Here the commit also
goes to a file read with ``weights_only=True`` (see :mod:`.commit_file`), which
refuses most classes. :func:`to_plain` therefore stores the common ones as tagged
tuples of plain values, and :func:`from_plain` rebuilds them on a restart with
their own type and value:

* numpy scalars (``np.mean(...)``, ``np.int64``): the number and its dtype;
* ``enum.Enum`` members (``IntEnum`` included): the class and the member's value;
* named tuples: the class and the fields;
* ``collections.defaultdict``: the ``default_factory`` and the items.

A class must be importable by name (defined at the top level of a module or of
the script) so that the restart can find it. Anything else that the loader
refuses (a custom object, a lambda ``default_factory``, a ``pathlib.Path``)
raises ``TypeError`` at ``commit()``, naming the value, instead of a file that
no restart could read. The test of what the loader accepts is
``trainbridge.runtime.weights_only.unloadable_value``, the one ``job.save`` uses.
"""

from __future__ import annotations

import collections
import enum
import importlib
import sys
from typing import Any, Optional, Type

import torch

from ...runtime.weights_only import PLAIN_TYPES, unloadable_value

TAG = "__trainbridge.hvd.elastic.typed__"  # first item of a tagged tuple: (TAG, kind, class name, payload)
CONTAINERS = (list, tuple, set, frozenset)


def _class_name(cls: Any, where: str, what: str) -> str:
    """``module:qualname`` of ``cls``, checked to lead back to it (TypeError otherwise)."""
    name = f"{getattr(cls, '__module__', None)}:{getattr(cls, '__qualname__', None)}"
    try:
        found = _resolve(name)
    except (ImportError, AttributeError, ValueError):
        found = None
    if found is not cls:
        raise TypeError(
            f"hvd.elastic: {where} is a {what} {getattr(cls, '__qualname__', cls)!r} that a restart "
            f"cannot import by name; define it at the top level of a module (or use plain values)"
        )
    return name


def _resolve(name: str) -> Any:
    module, _, qualname = name.partition(":")
    owner: Any = sys.modules.get(module) or importlib.import_module(module)
    for part in qualname.split("."):
        owner = getattr(owner, part)
    return owner


def _numpy_generic() -> Optional[Type[Any]]:
    numpy = sys.modules.get("numpy")  # never imported here: a numpy value means numpy is loaded
    return None if numpy is None else numpy.generic


def to_plain(value: Any, where: str = "state") -> Any:
    """``value`` with every numpy scalar, enum, named tuple and defaultdict tagged (see the module
    docstring); the same object where nothing changed. TypeError names a value no restart could load."""
    kind = type(value)
    if kind in PLAIN_TYPES or isinstance(value, torch.Tensor):
        return value
    numpy_generic = _numpy_generic()
    if numpy_generic is not None and isinstance(value, numpy_generic):
        return _tagged("numpy", value.dtype.str, value.item(), where)
    if isinstance(value, enum.Enum):
        return _tagged("enum", _class_name(kind, where, "enum"), value.value, where)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return _tagged("namedtuple", _class_name(kind, where, "named tuple"), list(value), where)
    if isinstance(value, collections.defaultdict):
        factory = value.default_factory
        factory_name = None if factory is None else _class_name(factory, f"{where}.default_factory", "function")
        return _tagged("defaultdict", factory_name, dict(value), where)
    if isinstance(value, dict) and (kind is dict or unloadable_value(kind(), where) is None):
        pairs = [(to_plain(k, f"{where} key"), to_plain(v, f"{where}[{k!r}]")) for k, v in value.items()]
        if all(k2 is k and v2 is v for (k2, v2), (k, v) in zip(pairs, value.items())):
            return value
        rebuilt = kind(pairs)
        if hasattr(value, "__dict__"):
            rebuilt.__dict__.update(value.__dict__)  # a state_dict's _metadata
        return rebuilt
    if kind in CONTAINERS:
        items = [to_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return value if all(a is b for a, b in zip(items, value)) else kind(items)
    problem = unloadable_value(value, where)
    if problem is not None:
        inside = "" if problem.startswith(f"{where} holds") else f" ({problem})"  # deeper in an allowed class
        raise TypeError(
            f"hvd.elastic: {where} is a {kind.__name__}{inside}, which the commit file cannot hold "
            f"(torch.load(weights_only=True) refuses it on a restart): store a state_dict or plain "
            f"values (numbers, strings, tensors and dicts/lists/tuples of them)"
        )
    return value  # a class the loader accepts (an OrderedDict state_dict, a Counter): kept as it is


def _tagged(kind: str, name: Optional[str], payload: Any, where: str) -> tuple:
    return (TAG, kind, name, to_plain(payload, where))


def from_plain(value: Any) -> Any:
    """The values :func:`to_plain` tagged, rebuilt with their own types."""
    kind = type(value)
    if kind is tuple and len(value) == 4 and value[0] == TAG:
        _, tag, name, payload = value
        payload = from_plain(payload)
        if tag == "numpy":
            import numpy

            return numpy.dtype(name).type(payload)
        if tag == "enum":
            return _resolve(name)(payload)
        if tag == "namedtuple":
            return _resolve(name)(*payload)
        return collections.defaultdict(None if name is None else _resolve(name), payload)
    if kind is dict:
        return {from_plain(k): from_plain(v) for k, v in value.items()}
    if kind in (list, tuple, set, frozenset):
        return kind(from_plain(v) for v in value)
    if isinstance(value, collections.OrderedDict):
        for key, item in value.items():  # a state_dict keeps its class and _metadata
            value[key] = from_plain(item)
    return value
