"""Data of the built-in tasks: in-memory MNIST and image folders. Sharding comes from the public API's loaders."""

from .mnist import MnistData, Split, load_mnist

__all__ = ["MnistData", "Split", "load_mnist"]
