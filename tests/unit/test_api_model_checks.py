"""trainbridge.api.model_checks: mistakes in a model that PyTorch accepts silently or with a traceback,
refused by ``job.prepare`` in one line."""
import pytest
import torch
from one_rank_job import one_rank_job

from trainbridge.api.model_checks import check_something_to_train
from trainbridge.errors import UserError


def frozen() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU()).requires_grad_(False)


def test_a_model_with_nothing_to_train_is_one_line():
    with pytest.raises(UserError, match=r"^job\.prepare: the model has nothing to train \(all 2 of its parameters "
                                        r"are frozen\), so there are no gradients to average; unfreeze what should "
                                        r"train \(requires_grad_\(True\)\) before job\.prepare, or, to evaluate it "
                                        r"only, move it with model\.to\(job\.device\) instead$"):
        check_something_to_train(frozen())
    with pytest.raises(UserError, match=r"nothing to train \(it has no parameters\)"):
        check_something_to_train(torch.nn.ReLU())
    model = frozen()
    model[0].bias.requires_grad_(True)
    check_something_to_train(model)  # one trainable tensor is enough


def test_job_prepare_refuses_it_before_the_backend_sees_it():
    with one_rank_job() as job:
        with pytest.raises(UserError, match=r"^job\.prepare: the model has nothing to train"):
            job.prepare(frozen(), None)
