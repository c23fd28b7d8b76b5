"""Horovod's own PyTorch tests (test/parallel/test_torch.py, 0.28.1), one module per Horovod API area.

``tests/hvd_scripts/horovod_suite.py`` runs them, module by module in the order of ``MODULES``
there; ``common.py`` holds what the modules share (the dtypes and dimensions Horovod's tests
loop over, their input tensors, ``expect_error``, the even and odd process sets, ...).

Importing this package sets ``HOROVOD_DYNAMIC_PROCESS_SETS=1``, before any of its modules
imports ``trainbridge.hvd``: Horovod's test_torch.py enables dynamic process sets before init,
for its ``*_process_sets`` tests.
"""

import os

os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
