"""``python -m benchmarks [--quick] ...``, from the checkout's root: the peer bench (``benchmarks/bench``)."""

import sys

from benchmarks.bench.cli import main

sys.exit(main())
