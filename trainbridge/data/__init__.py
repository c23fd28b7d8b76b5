"""Data: in-memory MNIST and index-gathered batches. Sharding comes from the backend."""
from .batches import iterate_batches, num_batches
from .mnist import MnistData, Split, load_mnist

__all__ = ["MnistData", "Split", "iterate_batches", "load_mnist", "num_batches"]
