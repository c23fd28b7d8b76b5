"""SyncBatchNorm: one sample per rank normalizes as BatchNorm1d over all of them, gradients included."""

import torch

import trainbridge.hvd as hvd

from .common import expect_error, multi_rank_only


def test_sync_batch_norm():
    multi_rank_only()  # one sample per rank: a single process has one value per channel
    if hvd.using_real_horovod and not torch.cuda.is_available():
        # The real Horovod's SyncBatchNorm is GPU-only; check that it says so.
        expect_error(lambda: hvd.SyncBatchNorm(4)(torch.randn(2, 4, 3)), ValueError)
        return
    ts_list = [
        torch.stack([torch.tensor([[r, r + 1], [r * 2, r * 2 + 1], [r * 3, r * 3 + 1], [r * 4, r * 4 + 1]])
                     for r in range(hvd.size())]),
        torch.stack([torch.tensor([[r + 1], [r * 2 + 1], [r * 3 + 1], [r * 4 + 1]]) for r in range(hvd.size())]),
    ]
    for ts in ts_list:
        # The reference BatchNorm runs in float64: with 3 ranks the middle rank's values sit on the mean,
        # where a float32 reference is off by an ulp (-6e-8 instead of 0) and a relative tolerance cannot help.
        sync_bn, bn = hvd.SyncBatchNorm(num_features=4), torch.nn.BatchNorm1d(num_features=4).double()
        ts = ts.float()
        ts1, ts2 = ts.clone().requires_grad_(), ts.double().requires_grad_()
        sync_bn_out = sync_bn(ts1[hvd.rank()].unsqueeze(0))
        bn_out = bn(ts2)
        assert torch.allclose(sync_bn_out, bn_out[hvd.rank()].unsqueeze(0).float(), 1e-6)
        assert torch.allclose(sync_bn.running_mean, bn.running_mean.float(), 1e-6)
        assert torch.allclose(sync_bn.running_var, bn.running_var.float(), 1e-6)
        sync_bn_out.sum().backward()
        bn_out.mean(dim=0).sum().backward()
        assert torch.allclose(hvd.allreduce(sync_bn.weight.grad, name="sync_bn.weight.grad"), bn.weight.grad.float(),
                              1e-6)
        assert torch.allclose(hvd.allreduce(sync_bn.bias.grad, name="sync_bn.bias.grad"), bn.bias.grad.float(), 1e-6)
        assert torch.allclose(hvd.allreduce(ts1.grad, name="ts1.grad"), ts2.grad.float(), 1e-5)
