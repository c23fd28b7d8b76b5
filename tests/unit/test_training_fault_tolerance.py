"""trainbridge.training.fault_tolerance: ``--fail-at-step`` fails once, on one rank, before one step.

Its ``os._exit`` runs in a child ``python -c`` only; here, a call that would end pytest raises instead.
"""
import os

import pytest
from python_child import run_python

from trainbridge.training import fault_tolerance
from trainbridge.training.fault_tolerance import INJECTED_FAILURE_EXIT_CODE, maybe_fail


@pytest.fixture(autouse=True)
def exit_raises(monkeypatch):
    def refuse(code):
        raise AssertionError(f"maybe_fail ended the process with {code}")
    monkeypatch.setattr(fault_tolerance.os, "_exit", refuse)


@pytest.mark.parametrize("fail_at_step, fail_rank, rank, step", [
    (None, 0, 0, 3),  # no --fail-at-step
    (3, 0, 0, 2),     # another step
    (3, 1, 0, 3),     # another rank
])
def test_nothing_happens_off_the_chosen_rank_and_step(tmp_path, fail_at_step, fail_rank, rank, step):
    maybe_fail(fail_at_step, fail_rank, rank, step, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()  # not even the marker's folder


def test_the_restarted_run_finds_the_marker_and_does_not_fail_again(tmp_path):
    (tmp_path / ".failed-at-step-3").write_text("rank 0 failed on purpose before step 3\n")
    maybe_fail(3, 0, 0, 3, str(tmp_path))
    assert os.listdir(tmp_path) == [".failed-at-step-3"]


def test_the_chosen_rank_leaves_abruptly_once_and_leaves_a_marker(tmp_path):
    output_dir = tmp_path / "out"
    code = f"""
        from trainbridge.training.fault_tolerance import maybe_fail
        maybe_fail(3, 1, 1, 3, {str(output_dir)!r})
        print("went on")
    """
    result = run_python(code)
    assert result.returncode == INJECTED_FAILURE_EXIT_CODE == 86, result
    assert result.stdout == "[trainbridge] --fail-at-step: rank 1 exits abruptly before step 3\n"
    assert (output_dir / ".failed-at-step-3").read_text() == "rank 1 failed on purpose before step 3\n"
    restarted = run_python(code)
    assert restarted.returncode == 0 and restarted.stdout == "went on\n", restarted
