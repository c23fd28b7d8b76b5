"""The end-of-training report: accuracy, per-class precision and recall, confusion matrix.

Exact under any world size: every rank scores its unpadded evaluation shard
(each sample on exactly one rank) and the confusion-matrix counts are summed
over ranks. The main rank prints the table and writes, in ``--output-dir``:

* ``report_<split>.json`` -- accuracy, loss, per-class precision/recall/support,
  the confusion matrix (rows: true class, columns: predicted class), the epoch
  of the weights scored;
* ``confusion_<split>.png`` -- the confusion matrix as a picture.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Sequence

import torch

from ..api import EvalLoader, Job
from ..errors import UserError
from ..optional import check_installed
from ..tasks import Task
from ..tasks.checks import check_loss, metric_sums

EVAL_SPLITS = ("val", "test")
# The first-batch check loads in this process: no worker processes for two samples.
WORKER_OPTIONS = ("num_workers", "prefetch_factor", "persistent_workers", "multiprocessing_context")


@torch.no_grad()
def evaluate(model: torch.nn.Module, task: Task, split: str, job: Job, batch_size: int) -> Dict[str, float]:
    """Exact loss and the task's metrics over the whole split, whatever the world size.

    ``<split>_samples`` is how many samples were scored: the split's size, each counted once.
    A task without the split (``eval_dataset`` returns None) gets no scores: ``{}``.

    ``model`` must be the unwrapped module: a forward pass of the DDP wrapper
    may run collectives (buffer broadcasts, when enabled), which hang when ranks
    have different numbers of evaluation batches.
    """
    dataset = task.eval_dataset(split)
    if dataset is None:
        return {}
    was_training = model.training
    model.eval()
    sums: Dict[str, torch.Tensor] = {}
    count = 0
    for inputs, targets in job.eval_loader(dataset, batch_size, **task.loader_options(split)):
        outputs = model(inputs)
        batch = {
            "loss": task.loss(outputs, targets, reduction="sum").detach().double(),
            **metric_sums(task, task.metrics(outputs, targets), quiet=not job.is_main),
        }
        for name, value in batch.items():
            sums[name] = sums.get(name, 0) + value
        count += len(targets)
    model.train(was_training)
    # The metric names come from the batches: a rank with an empty shard (fewer samples than ranks) has none.
    names = sorted({name for ranks in job.allgather_object(sorted(sums)) for name in ranks})
    local = torch.tensor(
        [float(sums[n]) if n in sums else 0.0 for n in names] + [float(count)], dtype=torch.float64, device=job.device
    )
    # Each sample was seen by exactly one rank, so global sums are exact.
    *totals, total_count = job.allreduce(local, "sum").tolist()
    return {
        **{f"{split}_{name}": value / total_count for name, value in zip(names, totals)},
        f"{split}_samples": int(total_count),
    }


@torch.no_grad()
def check_first_batch(model: torch.nn.Module, task: Task, job: Job, batch_size: int) -> None:
    """Before any step: the evaluation loss and metrics of the validation split's first two samples are numbers.

    A task whose metrics could not be summed would otherwise fail after its first
    epoch of training. Every rank checks the same samples alike; rank 0 says why.
    """
    dataset = task.eval_dataset("val")
    if dataset is None:
        return
    options = {k: v for k, v in task.loader_options("val").items() if k not in WORKER_OPTIONS}
    try:
        loader = EvalLoader(dataset, min(batch_size, 2), rank=0, world_size=1, device=job.device, **options)
    except UserError as exc:  # not a map-style dataset, or options no loader takes: the same on every rank
        raise UserError(f"{type(task).__name__}.eval_dataset('val'): {exc}", quiet=not job.is_main) from None
    inputs, targets = next(iter(loader))
    was_training = model.training
    model.eval()
    outputs = model(inputs)
    check_loss(task, task.loss(outputs, targets, reduction="sum"), "sum", quiet=not job.is_main)
    metric_sums(task, task.metrics(outputs, targets), quiet=not job.is_main)
    model.train(was_training)


def confusion_matrix(labels: torch.Tensor, predictions: torch.Tensor, num_classes: int) -> torch.Tensor:
    """int64 [num_classes, num_classes]: entry [t, p] counts samples of true class t predicted as p."""
    flat = labels.long() * num_classes + predictions.long()
    return torch.bincount(flat, minlength=num_classes * num_classes).reshape(num_classes, num_classes)


def precision_recall(matrix: torch.Tensor) -> Dict[str, List[Optional[float]]]:
    """Per class: precision = TP / predicted, recall = TP / true; None where the denominator is 0."""
    matrix = matrix.double()
    true_positive = matrix.diagonal()
    predicted, actual = matrix.sum(dim=0), matrix.sum(dim=1)
    ratio = lambda num, den: [None if d == 0 else float(n / d) for n, d in zip(num.tolist(), den.tolist())]  # noqa: E731
    return {"precision": ratio(true_positive, predicted), "recall": ratio(true_positive, actual)}


def summarise(matrix: torch.Tensor, class_names: Sequence[str], split: str, loss_sum: float) -> Dict[str, Any]:
    """The report dict of a (global) confusion matrix."""
    total = int(matrix.sum())
    scores = precision_recall(matrix)
    return {
        "split": split,
        "samples": total,
        "accuracy": float(matrix.diagonal().sum()) / total if total else None,
        "loss": loss_sum / total if total else None,
        "classes": list(class_names),
        "per_class": {
            name: {"precision": scores["precision"][i], "recall": scores["recall"][i], "support": int(matrix[i].sum())}
            for i, name in enumerate(class_names)
        },
        "confusion_matrix": matrix.tolist(),
        "confusion_matrix_axes": "rows: true class, columns: predicted class (order of 'classes')",
    }


@torch.no_grad()
def classification_report(model: torch.nn.Module, task: Task, split: str, job: Job, batch_size: int) -> Dict[str, Any]:
    """Score ``split`` exactly across ranks; every rank returns the same report.

    ``model`` is the unwrapped module (``job.unwrap(model)``: DDP's buffer broadcast must not run on uneven shards) and
    must be identical on every rank, buffers included.
    """
    class_names = task.class_names
    assert class_names is not None  # report_model scores classifier tasks only (those with class names)
    was_training = model.training
    model.eval()
    num_classes = len(class_names)
    local = torch.zeros(num_classes, num_classes, dtype=torch.int64, device=job.device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=job.device)
    for images, labels in job.eval_loader(task.eval_dataset(split), batch_size, **task.loader_options(split)):
        logits = model(images)
        loss_sum += task.loss(logits, labels, reduction="sum").double()
        local += confusion_matrix(labels, logits.argmax(dim=1), num_classes)
    model.train(was_training)
    # Each sample was scored by exactly one rank: summing the counts gives the
    # global matrix. One float64 collective carries counts (exact below 2**53) and loss.
    totals = job.allreduce(torch.cat([local.double().flatten(), loss_sum.reshape(1)]), "sum").cpu()
    matrix = totals[:-1].round().long().reshape(num_classes, num_classes)
    return summarise(matrix, class_names, split, float(totals[-1]))


def format_report(report: Dict[str, Any]) -> str:
    """A plain-text table: per-class precision/recall/support, accuracy, and the confusion matrix."""
    names: List[str] = report["classes"]
    width = max(8, *(len(n) for n in names))
    pct = lambda v: "    -" if v is None else f"{100 * v:5.1f}"  # noqa: E731
    lines = [f"{'class':<{width}}  precision  recall  support"]
    for name in names:
        row = report["per_class"][name]
        lines.append(f"{name:<{width}}  {pct(row['precision'])}%    {pct(row['recall'])}%  {row['support']:7d}")
    lines.append(f"{'accuracy':<{width}}  {pct(report['accuracy'])}% of {report['samples']}")
    lines.append("confusion matrix (rows: true, columns: predicted)")
    lines.append(" " * width + "  " + " ".join(f"{n:>{width}}" for n in names))
    for name, counts in zip(names, report["confusion_matrix"]):
        lines.append(f"{name:<{width}}  " + " ".join(f"{c:>{width}d}" for c in counts))
    return "\n".join(lines)


def check_report_libraries(task: Task, quiet: bool = False) -> None:
    """A classifier's report ends with a picture: check for matplotlib (and the pillow it uses) before training."""
    if task.class_names:
        check_installed(["matplotlib", "PIL"], "the confusion-matrix picture written after training", quiet=quiet)


def plot_confusion(report: Dict[str, Any], path: str) -> None:
    """Save the confusion matrix as a PNG (matplotlib's Agg canvas: no display, no pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names: List[str] = report["classes"]
    matrix = torch.tensor(report["confusion_matrix"])
    size = 2.0 + 0.6 * len(names)
    figure = Figure(figsize=(size, size))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.imshow(matrix.numpy(), cmap="Blues")
    axes.set_xticks(range(len(names)), names, rotation=45, ha="right")
    axes.set_yticks(range(len(names)), names)
    axes.set_xlabel("predicted")
    axes.set_ylabel("true")
    accuracy = report["accuracy"]
    axes.set_title(f"{report['split']}: accuracy {100 * accuracy:.1f}%" if accuracy is not None else report["split"])
    threshold = matrix.max().item() / 2
    for t in range(len(names)):
        for p in range(len(names)):
            axes.text(
                p,
                t,
                str(int(matrix[t, p])),
                ha="center",
                va="center",
                color="white" if matrix[t, p] > threshold else "black",
            )
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def save_report(report: Dict[str, Any], output_dir: str) -> List[str]:
    """Write ``report_<split>.json`` and ``confusion_<split>.png``; returns both paths."""
    os.makedirs(output_dir, exist_ok=True)
    json_path = os.path.join(output_dir, f"report_{report['split']}.json")
    png_path = os.path.join(output_dir, f"confusion_{report['split']}.png")
    with open(json_path, "w") as f:
        json.dump(report, f, indent=2)
    plot_confusion(report, png_path)
    return [json_path, png_path]


def report_model(
    model: torch.nn.Module, task: Task, job: Job, batch_size: int, output_dir: str, epoch: Optional[int]
) -> Dict[str, Dict[str, Any]]:
    """Score every evaluation split a classifier task has; the main rank prints and saves each report.

    Collective: every rank must call it. Tasks without class names get no report.
    """
    reports = {}
    for split in EVAL_SPLITS if task.class_names else ():
        if not task.eval_dataset(split):
            continue
        report = {**classification_report(model, task, split, job, batch_size), "epoch": epoch}
        if job.is_main:
            paths = save_report(report, output_dir)
            job.print(
                f"[trainbridge] {split} report of the best model (epoch {epoch}):\n"
                f"{format_report(report)}\n[trainbridge] wrote {' and '.join(paths)}"
            )
        reports[split] = report
    return reports
