"""Make ``import torchvision`` work on a CPU-only torch whose torchvision is a CUDA build.

Standalone on purpose: ``scripts/setup.sh`` copies this file into the venv's
site-packages together with a ``.pth`` line that calls :func:`install`, so the
fix applies to every interpreter of the venv, even scripts that never import
trainbridge.

Why: PyPI only has CUDA builds of torchvision 0.28. On the CPU torch its ``_C.so``
does not load (it needs ``libtorch_cuda.so``), so the ``torchvision::nms`` and
``torchvision::qnms`` operators are never defined, and
``torchvision/_meta_registrations.py`` fails when it registers fake kernels for
them. Defining the two schemas right before that module runs lets the import
succeed; datasets, transforms and models work, only the detection ops stay
unavailable. Where torchvision's C++ ops do load, this does nothing.

The hook costs nothing at interpreter start: it is a meta-path finder that
only acts when ``torchvision._meta_registrations`` is first imported.
"""
import importlib.abc
import sys

_TARGET = "torchvision._meta_registrations"
_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_keep_alive = []  # a torch.library.Library drops its definitions when collected


def define_missing_schemas() -> None:
    """Define the torchvision nms/qnms schemas when torchvision's C++ ops did not load."""
    import torch

    missing = [name for name in _SCHEMAS if not hasattr(torch.ops.torchvision, name)]
    if not missing:
        return
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for name in missing:
        lib.define(_SCHEMAS[name])
    _keep_alive.append(lib)


class _BeforeMetaRegistrations(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname == _TARGET:
            sys.meta_path.remove(self)
            try:
                define_missing_schemas()
            except Exception:  # never break an import that might work anyway
                pass
        return None  # let the normal finders load the module


def install() -> None:
    """Register the import hook once per interpreter."""
    if not any(isinstance(f, _BeforeMetaRegistrations) for f in sys.meta_path):
        sys.meta_path.insert(0, _BeforeMetaRegistrations())
