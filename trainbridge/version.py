"""The version of trainbridge: written here only (setup.cfg and ``trainbridge --version`` read it)."""

__version__ = "0.1.0"
