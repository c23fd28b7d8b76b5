"""Print which implementation ``import trainbridge.hvd`` chose, and check one allreduce with it."""
import torch

import trainbridge.hvd as hvd

hvd.init()
total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
print(f"BACKEND rank={hvd.rank()} size={hvd.size()} real_horovod={hvd.using_real_horovod} "
      f"mpi_enabled={hvd.mpi_enabled()} sum={total:g}", flush=True)
hvd.shutdown()
