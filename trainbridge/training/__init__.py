"""The training engine behind ``trainbridge train``, built on the public API."""
