"""Writers for ``bench.json`` (everything), ``bench.md`` (tables) and ``bench.png`` (throughput chart)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any, Dict, List, Optional

from .configs import COMPARED
from .targets import ratio_spread


def write_json(result: Dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(result, indent=2) + "\n")


def fmt(value: Optional[float], pattern: str, scale: float = 1.0) -> str:
    return "n/a" if value is None else format(value * scale, pattern)


def config_table(configs: Dict[str, Dict[str, Any]]) -> List[str]:
    lines = [
        "| configuration | kind | processes x threads | samples/s (median) | min-max | step median (ms) "
        "| step p90 (ms) | scaling efficiency | peak RSS per rank (MiB) | other load | status |",
        "|---|---|---|---:|---|---:|---:|---:|---|---:|---|",
    ]
    for key, c in configs.items():
        rss = "n/a" if not c["peak_rss_mb_per_rank"] else " / ".join(f"{v:.0f}" for v in c["peak_rss_mb_per_rank"])
        spread = (
            "n/a"
            if c["samples_per_second_min"] is None
            else f"{c['samples_per_second_min']:,.0f}-{c['samples_per_second_max']:,.0f}"
        )
        lines.append(
            f"| {c['label']} (`{key}`) | {c['kind']} | {c['nproc']} x {c['threads_per_rank']} "
            f"| {fmt(c['samples_per_second'], ',.0f')} | {spread} | {fmt(c['step_time_median'], '.1f', 1e3)} "
            f"| {fmt(c['step_time_p90'], '.1f', 1e3)} | {fmt(c.get('scaling_efficiency'), '.0%')} | {rss} "
            f"| {fmt(c['foreign_cpu_median'], '.0%')} | {c['status']} |"
        )
    return lines


def peer_table(configs: Dict[str, Dict[str, Any]], val_set_size: Optional[int]) -> List[str]:
    """Whole runs side by side: what a user choosing between trainbridge and its peers feels."""
    lines = [
        f"| run | wall time, launch to exit (s) | time to first step (s) | samples/s, steady state "
        f"| validation samples counted with 3 ranks (of {val_set_size or 'n/a'}) | wall time per repeat (s) "
        f"| GPU busy, launch to exit |",
        "|---|---:|---:|---:|---:|---|---:|",
    ]
    for key in COMPARED:
        c = configs.get(key)
        if not c or c["status"] == "skipped":
            continue
        walls = ", ".join(f"{r['wall_seconds']:.1f}" for r in c["runs"] if r["status"] == "ok") or "n/a"
        counted = c.get("val_samples_3_ranks")
        lines.append(
            f"| {c['label']} (`{key}`) | {fmt(c.get('wall_seconds'), '.1f')} "
            f"| {fmt(c.get('first_step_seconds'), '.1f')} | {fmt(c['samples_per_second'], ',.0f')} "
            f"| {counted if counted is not None else 'n/a'} | {walls} | {fmt(c.get('gpu_busy'), '.0%')} |"
        )
    return lines


def target_table(targets: List[Dict[str, Any]]) -> List[str]:
    lines = ["| target | measured | ratio | threshold | met | ratio per repeat |", "|---|---|---:|---:|---|---|"]
    for t in targets:
        if not isinstance(t["reference"], str):
            reference = f"best of {', '.join(f'`{r}`' for r in t['reference'])}"
            if t.get("best_reference"):
                reference += f" (`{t['best_reference']}`)"
        elif t["scale_by_nproc"]:
            reference = f"{t.get('scale', 'N')} x `{t['reference']}`"
        else:
            reference = f"`{t['reference']}`"
        if t["threshold"] is None:
            threshold, met = "-", "reference"
        else:
            sign = "<=" if t["metric"] == "wall_seconds" else ">="
            threshold = f"{sign} {t['threshold']:.2f}"
            met = {True: "**met**", False: "**not met**", None: "n/a"}[t["met"]]
        lines.append(
            f"| {t['id']} {t['name']} | `{t['config']}` / {reference} | {fmt(t['ratio'], '.3f')} "
            f"| {threshold} | {met} | {ratio_spread(t) or 'n/a'} |"
        )
    return lines


def markdown(result: Dict[str, Any]) -> str:
    m, s = result["machine"], result["settings"]
    out = [
        f"# trainbridge peer bench ({s['mode']}, {s['repeats']} repeat{'s' if s['repeats'] != 1 else ''})",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Machine: {m['cores']} cores, {m['platform']}, Python {m['python']}, torch {m['torch']}, "
        f"horovod {m['horovod']}; {result['created']}.",
        "",
        f"Threads per rank: {s['threads_policy']} (given to every run as `--threads` and `OMP_NUM_THREADS`). "
        f"Samples/s are global (summed over ranks) after warm-up; step times are rank 0's. Each figure is "
        f"the median over interleaved repeats. Scaling efficiency = samples/s / (processes x threads x the "
        f"one-thread unit). Other load = share of all cores used by processes outside the run while it ran.",
        "",
    ]
    for name, w in result["workloads"].items():
        out += [
            f"## {name}: {w['description']}",
            "",
            f"{w['steps']} optimizer steps per process, the first {w['warmup_steps']} (and each epoch's "
            f"first) left out of the timing; batch {w['batch_size']} per process.",
            "",
            *config_table(w["configs"]),
            "",
            "### trainbridge and its peers, whole runs",
            "",
            "Each run evaluates at every epoch end and writes a checkpoint; wall time is from the launcher's "
            "start to its exit. Validation samples counted: a separate run of each with 3 ranks.",
            "",
            *peer_table(w["configs"], w.get("val_set_size")),
            "",
            "### Targets",
            "",
            *target_table(w["targets"]),
            "",
        ]
        for key, c in w["configs"].items():
            if c["status"] == "skipped":
                out += [f"**{key} skipped**: {c['skip_reason']}.", ""]
            elif c["status"] != "ok":
                out += [f"**{key} failed**:", "", "```", *(e.strip()[-800:] for e in c["errors"]), "```", ""]
    return "\n".join(out)


def write_markdown(result: Dict[str, Any], path: Path) -> None:
    path.write_text(markdown(result))


def write_png(result: Dict[str, Any], path: Path) -> None:
    """Throughput by configuration, each trainbridge bar beside its baseline, min-max whiskers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = result["workloads"]
    fig, axes = plt.subplots(len(workloads), 1, figsize=(14, 5.8 * len(workloads)), squeeze=False)
    colours = {"trainbridge": "#2b6cb0", "baseline": "#a0aec0", "peer": "#dd6b20"}
    for ax, (name, w) in zip(axes[:, 0], workloads.items()):
        groups: Dict[str, List[str]] = {}
        for key, c in w["configs"].items():
            groups.setdefault(c["group"], []).append(key)
        x, ticks, ticklabels = 0.0, [], []
        for group, keys in groups.items():
            start = x
            for key in keys:
                c = w["configs"][key]
                rate = c["samples_per_second"] or 0.0
                err = (
                    [[rate - c["samples_per_second_min"]], [c["samples_per_second_max"] - rate]]
                    if c["samples_per_second_min"] is not None
                    else None
                )
                ax.bar(
                    x,
                    rate,
                    width=0.8,
                    color=colours[c["kind"]],
                    yerr=err,
                    capsize=3,
                    hatch="" if c["kind"] == "trainbridge" else "//",
                    edgecolor="black",
                    linewidth=0.5,
                    label=c["kind"],
                )
                ax.text(
                    x,
                    rate,
                    c["status"].upper() if c["status"] != "ok" else f"{rate:,.0f}",
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )
                ticks.append(x)
                ticklabels.append(textwrap.fill(c["label"], width=15, break_long_words=False))
                x += 1.0
            ax.axvspan(start - 0.5, x - 0.5, color="#edf2f7", zorder=0)
            ax.text(
                (start + x - 1.0) / 2,
                -0.17,
                group,
                transform=ax.get_xaxis_transform(),
                ha="center",
                va="top",
                fontsize=8,
                fontweight="bold",
            )
            x += 0.5
        unit = w["configs"].get("local_1_thread", {}).get("samples_per_second")
        cores = result["machine"]["cores"]
        if unit:
            ax.axhline(cores * unit, linestyle="--", color="#c53030", linewidth=1)
            ax.text(
                -0.4, cores * unit, f"{cores} x one-thread unit", color="#c53030", va="bottom", ha="left", fontsize=8
            )
        ax.set_xticks(ticks, ticklabels, fontsize=7)
        ax.set_xlim(-0.6, x - 0.9)
        ax.set_ylim(
            0,
            max([cores * (unit or 0)] + [(c["samples_per_second_max"] or 0) for c in w["configs"].values()]) * 1.15
            or 1,
        )
        ax.set_ylabel("samples/s (global, after warm-up)")
        ax.set_title(
            f"{name}: throughput by configuration, baselines hatched "
            f"({result['settings']['mode']}, median of {result['settings']['repeats']})",
            fontsize=10,
        )
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles))
        ax.legend(unique.values(), unique.keys(), loc="upper right", fontsize=8, framealpha=1)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
