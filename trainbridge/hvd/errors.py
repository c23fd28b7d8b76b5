"""The exceptions ``trainbridge.hvd`` raises, as Horovod's PyTorch API raises them.

Each is (a subclass of) the type Horovod 0.28.1 raises in the same case, so a Horovod
user's ``except`` clauses keep working; ``hvd.HorovodInternalError`` is the public one.
A rank that rejects its input tells its peers the exception's type by name, and each peer
raises the same type (``rejection_error``; see negotiation.decide).
"""

from __future__ import annotations


class HorovodInternalError(RuntimeError):
    """A collective could not complete: a peer failed, left, or the job shut down."""


class TensorMismatchError(HorovodInternalError):
    """Ranks submitted the same named operation with different shapes, dtypes, ops or roots.

    A HorovodInternalError, as in Horovod, whose ``synchronize`` raises that type for
    every error its coordinator reports.
    """


class ScalarInputError(ValueError, IndexError):
    """A 0-d tensor where a first dimension is needed (allgather, alltoall, reducescatter).

    Horovod raises ValueError for reducescatter and IndexError for allgather; both catch this.
    """


class UnsupportedOpError(HorovodInternalError, ValueError):
    """A reduction op the operation does not support (Horovod raises HorovodInternalError; ValueError reads better)."""


class UnregisteredProcessSetError(ValueError, TypeError):
    """A process set that was never registered or was removed (Horovod fails with a TypeError there)."""


# Types a rank's rejected input may raise; its peers raise the same type (see negotiation.decide).
REJECTION_TYPES = {
    cls.__name__: cls
    for cls in (
        ValueError,
        TypeError,
        NotImplementedError,
        ScalarInputError,
        TensorMismatchError,
        HorovodInternalError,
        UnsupportedOpError,
        UnregisteredProcessSetError,
    )
}


def rejection_error(error_type: str, message: str) -> Exception:
    """The exception a peer's rejection names (by type name), with ``message``; HorovodInternalError if unknown."""
    return REJECTION_TYPES.get(error_type, HorovodInternalError)(message)
