"""trainbridge: one PyTorch training loop for every launcher."""
__version__ = "0.1.0"
