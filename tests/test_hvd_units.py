"""Pure parts of trainbridge.hvd, without processes: negotiation, delegation, ops, compression, commit paths."""
import os

import pytest
import torch

from trainbridge.errors import UserError
from trainbridge.hvd import delegation, errors
from trainbridge.hvd.compression import Compression
from trainbridge.hvd.elastic import commit_file
from trainbridge.hvd.engine import scaled
from trainbridge.hvd.errors import HorovodInternalError, rejection_error
from trainbridge.hvd.negotiation import Announcement, Message, NegotiationTable
from trainbridge.hvd.process_sets import check_static_sets
from trainbridge.hvd.reduce_ops import Adasum, Average, Max, Sum, resolve_op

FLOAT_17 = Announcement("allreduce", ((17,),), ("torch.float32",))


def cycle(table, *per_rank):
    return table.apply([Message(list(announcements)) if not isinstance(announcements, Message) else announcements
                        for announcements in per_rank])


def test_an_operation_is_ready_once_every_rank_named_it_in_any_order():
    table = NegotiationTable(2)
    outcome = cycle(table, [("a", FLOAT_17), ("b", FLOAT_17)], [("b", FLOAT_17)])
    assert [d.name for d in outcome.ready] == ["b"] and outcome.ready[0].error is None
    assert list(table.pending) == [(0, "a")]  # (process set id, name)
    outcome = cycle(table, [], [("a", FLOAT_17)])
    assert [d.name for d in outcome.ready] == ["a"] and not table.pending


def test_shape_dtype_op_and_root_mismatches_are_errors_naming_both_values():
    table = NegotiationTable(2)
    other_shape = Announcement("allreduce", ((18,),), ("torch.float32",))
    other_dtype = Announcement("allreduce", ((17,),), ("torch.int32",))
    other_op = Announcement("allreduce", ((17,),), ("torch.float32",), op=Max)
    root0, root1 = Announcement("broadcast", ((3,),), ("torch.float32",), root=0), \
        Announcement("broadcast", ((3,),), ("torch.float32",), root=1)
    outcome = cycle(table, [("s", FLOAT_17), ("d", FLOAT_17), ("o", FLOAT_17), ("r", root0), ("k", FLOAT_17)],
                    [("s", other_shape), ("d", other_dtype), ("o", other_op), ("r", root1), ("k", root0)])
    errors = {d.name: d.error for d in outcome.ready}
    assert "shape" in errors["s"] and "rank 0 has [17]" in errors["s"] and "rank 1 has [18]" in errors["s"]
    assert "dtype" in errors["d"] and "torch.int32" in errors["d"]
    assert "reduction op" in errors["o"] and "Max" in errors["o"]
    assert "root rank" in errors["r"]
    assert "different operations" in errors["k"]


def test_allgather_may_differ_only_in_the_first_dimension():
    table = NegotiationTable(2)
    rows = lambda *shape: Announcement("allgather", (shape,), ("torch.float32",))  # noqa: E731
    outcome = cycle(table, [("ok", rows(3, 4)), ("bad", rows(3, 4))], [("ok", rows(5, 4)), ("bad", rows(3, 5))])
    errors = {d.name: d.error for d in outcome.ready}
    assert errors["ok"] is None and "after the first dimension" in errors["bad"]


def test_joined_ranks_answer_allreduce_but_not_other_operations():
    table = NegotiationTable(3)
    outcome = cycle(table, Message([], join=True), [("g", FLOAT_17)], [("g", FLOAT_17)])
    ready = outcome.ready[0]
    assert ready.name == "g" and ready.error is None and sorted(ready.by_rank) == [1, 2]
    gather = Announcement("allgather", ((2,),), ("torch.float32",))
    outcome = cycle(table, Message([]), [("x", gather)], [("x", gather)])
    assert "already called hvd.join()" in outcome.ready[0].error
    assert outcome.join_completed_by is None
    outcome = cycle(table, Message([]), Message([], join=True), Message([]))
    assert outcome.join_completed_by is None
    outcome = cycle(table, Message([]), Message([]), Message([], join=True))
    assert outcome.join_completed_by == 2 and table.joined == []


def test_process_set_operations_wait_for_the_members_only_and_names_are_per_set():
    table = NegotiationTable(3)
    table.members[1] = (0, 2)
    in_set = Announcement("allreduce", ((17,),), ("torch.float32",), process_set=1)
    outcome = cycle(table, [("g", in_set), ("g", FLOAT_17)], [("g", FLOAT_17)], [("g", in_set)])
    assert [(d.process_set, d.name) for d in outcome.ready] == [(1, "g")] and outcome.ready[0].error is None
    assert list(table.pending) == [(0, "g")]  # the global "g" still waits for rank 2
    outcome = cycle(table, [], [], [("g", FLOAT_17)])
    assert [(d.process_set, d.name) for d in outcome.ready] == [(0, "g")]


def test_a_rank_that_rejects_its_input_fails_the_operation_on_every_rank_with_its_type():
    table = NegotiationTable(2)
    rejected = Announcement("reducescatter", error=("ScalarInputError", "Reducescatter does not support scalars"))
    good = Announcement("reducescatter", ((4,),), ("torch.float32",))
    decision = cycle(table, [("r", rejected)], [("r", good)]).ready[0]
    assert decision.error_type == "ScalarInputError" and "rank 0: Reducescatter does not support" in decision.error
    error = rejection_error(decision.error_type, decision.error)
    assert isinstance(error, ValueError) and isinstance(error, IndexError)  # Horovod: ValueError / IndexError
    assert isinstance(rejection_error("TensorMismatchError", "x"), HorovodInternalError)


def test_horovods_exception_types_are_in_errors_and_hvd_exports_the_one_horovod_names():
    import trainbridge.hvd as hvd

    assert hvd.HorovodInternalError is errors.HorovodInternalError
    # Each is the type Horovod raises in its case, so Horovod users' except clauses keep working.
    assert issubclass(errors.TensorMismatchError, HorovodInternalError)
    assert issubclass(errors.UnsupportedOpError, HorovodInternalError)
    assert issubclass(errors.UnsupportedOpError, ValueError)
    assert issubclass(errors.ScalarInputError, ValueError) and issubclass(errors.ScalarInputError, IndexError)
    assert issubclass(errors.UnregisteredProcessSetError, TypeError)
    assert type(rejection_error("NoSuchType", "x")) is HorovodInternalError


def test_ranks_that_add_different_process_sets_all_get_value_error():
    table = NegotiationTable(2)
    decision = cycle(table, [("add.1", Announcement("add_process_set", ranks=(0,)))],
                     [("add.1", Announcement("add_process_set", ranks=(1,)))]).ready[0]
    assert decision.error_type == "ValueError" and "rank 0 has [0], rank 1 has [1]" in decision.error


def test_static_process_sets_must_agree_and_be_distinct():
    check_static_sets([[(0,), (1, 2)], [(0,), (1, 2)], [(0,), (1, 2)]], 3)
    with pytest.raises(ValueError, match=r"different process sets: rank 0 has \[\[0\]\]; rank 1 has \[\[1\]\]"):
        check_static_sets([[(0,)], [(1,)]], 2)
    with pytest.raises(ValueError, match="entry number 1 is a duplicate"):
        check_static_sets([[(0,), (0,)]] * 2, 2)
    with pytest.raises(ValueError, match="entry number 0 is a duplicate"):
        check_static_sets([[(0, 1)]] * 2, 2)  # the global set
    with pytest.raises(ValueError, match="not a set of distinct ranks"):
        check_static_sets([[(0, 5)]] * 2, 2)


def test_shutdown_of_any_rank_is_reported():
    table = NegotiationTable(2)
    assert cycle(table, Message([], shutdown=True), Message([])).shutdown_by == [0]


def test_horovod_scaling_rules():
    floats = torch.tensor([7.0, 11.0, 1e-3])
    # Horovod's ScaleBuffer casts the factor to float for float32 tensors: float32 arithmetic.
    assert torch.equal(scaled(floats, 1 / 3), floats * torch.tensor(1 / 3, dtype=torch.float32))
    ints = torch.tensor([-3, 3, 5], dtype=torch.int32)
    assert scaled(ints, 0.5).tolist() == [-1, 1, 2]  # float64, truncated (as horovod.torch 0.28.1)
    assert scaled(torch.ones(2, dtype=torch.float16), 1 / 3).dtype == torch.float16
    assert scaled(ints, 1.0) is ints


def test_resolve_op_follows_horovods_average_argument():
    assert resolve_op(None, None) == Average
    assert resolve_op(None, False) == Sum and resolve_op(None, True) == Average
    with pytest.raises(ValueError):
        resolve_op(Sum, True)
    with pytest.raises(NotImplementedError, match="horovodrun.*hvd.Average"):
        resolve_op(Adasum, None)


def test_fp16_compression_roundtrip():
    compressed, ctx = Compression.fp16.compress(torch.ones(3, dtype=torch.float64))
    assert compressed.dtype == torch.float16 and Compression.fp16.decompress(compressed, ctx).dtype == torch.float64
    ints, ctx = Compression.fp16.compress(torch.ones(3, dtype=torch.int64))
    assert ints.dtype == torch.int64 and Compression.none.compress(ints) == (ints, None)


@pytest.mark.parametrize("environ, ancestors, real", [
    ({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"}, [], True),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, ["mpirun -np 2 python t.py"], False),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, ["mpirun ...", "python horovodrun -np 2"], True),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", **delegation.HOROVODRUN_MPI_FLAGS}, [], True),
    ({"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2"}, ["python horovodrun"], False),
    ({}, [], False),
    ({"TRAINBRIDGE_HVD_BACKEND": "horovod"}, [], True),
    ({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2", "TRAINBRIDGE_HVD_BACKEND": "torch"}, [], False),
])
def test_delegation_follows_the_launcher(monkeypatch, environ, ancestors, real):
    monkeypatch.setattr(delegation, "ancestor_commands", lambda: iter(ancestors))
    assert delegation.use_real_horovod(environ) is real


def test_real_horovod_is_refused_under_torchrun():
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "2", "TRAINBRIDGE_HVD_BACKEND": "horovod"}
    with pytest.raises(UserError, match=r"TRAINBRIDGE_HVD_BACKEND=horovod cannot run under torchrun: Horovod would "
                                        r"see size 1 in each of the 2 processes; launch with horovodrun -np 2"):
        delegation.use_real_horovod(torchrun)
    assert delegation.use_real_horovod({**torchrun, "TRAINBRIDGE_HVD_BACKEND": "torch"}) is False


def test_commit_file_only_under_torchrun():
    assert commit_file.commit_path({}) is None
    default = commit_file.commit_path({"TORCHELASTIC_RUN_ID": "abc"})
    assert default.endswith(f"trainbridge-elastic-{os.geteuid()}-abc/state.pt")
    assert commit_file.commit_path({"TRAINBRIDGE_ELASTIC_DIR": "/ckpt"}) == "/ckpt/state.pt"
    assert not commit_file.is_restart({"TORCHELASTIC_RESTART_COUNT": "0"})
    assert commit_file.is_restart({"TORCHELASTIC_RESTART_COUNT": "1"})


def _name_table():
    """(names, status) per row of the "Every horovod.torch name" table in the migration guide."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "MIGRATING_FROM_HOROVOD.md").read_text()
    table = text.split("## Every name and its status", 1)[1].split("\n## ", 1)[0]  # up to the next section
    rows = [line.split("|")[1:3] for line in table.splitlines() if line.startswith("| `")]
    return [(re.findall(r"`(\w[\w.]*)`", names), status.strip()) for names, status in rows]


def test_migration_table_lists_every_horovod_torch_name_and_the_facade_has_the_supported_ones():
    import importlib

    import horovod.torch

    import trainbridge.hvd as hvd

    assert not hvd.using_real_horovod
    listed = {name.split(".")[0] for names, _ in _name_table() for name in names}
    public = {name for name in dir(horovod.torch) if not name.startswith("_")}
    assert public <= listed, f"missing from the table: {sorted(public - listed)}"
    for names, status in _name_table():
        assert status in ("yes", "differs", "no", "extra"), status  # extra: trainbridge-only, must exist too
        for name in names:
            if status != "no":
                owner = hvd
                for part in name.split("."):
                    owner = getattr(owner, part)  # raises if the facade lacks a supported name
    assert importlib.import_module("trainbridge.hvd.elastic").ObjectState


def test_commit_file_round_trips_state_dicts_with_weights_only(tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    snapshot = {"handlers": {"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                "objects": {"epoch": 3, "batch": 7, "history": [0.5, 0.25], "note": None}}
    path = str(tmp_path / "state.pt")
    commit_file.save(snapshot, path)
    loaded = commit_file.load(path)
    assert loaded["objects"] == snapshot["objects"]
    assert torch.equal(loaded["handlers"]["model"]["weight"], model.weight)
    assert loaded["handlers"]["optimizer"]["state"][0]["step"] == 1


def test_commit_file_is_synced_before_and_after_the_rename(tmp_path, monkeypatch):
    import os
    import stat

    path = tmp_path / "elastic" / "state.pt"
    commit_file.save({"objects": {"epoch": 1}}, str(path))
    synced = []  # (is a directory, path exists at that moment)
    real_fsync = os.fsync
    monkeypatch.setattr(commit_file.os, "fsync",
                        lambda fd: (synced.append((stat.S_ISDIR(os.fstat(fd).st_mode), path.exists())), real_fsync(fd)))
    commit_file.save({"objects": {"epoch": 2}}, str(path))
    assert synced == [(False, True), (True, True)]  # the new data, then the directory after the rename
    assert commit_file.load(str(path))["objects"] == {"epoch": 2}

    def full_disk(obj, f):
        f.write(b"torn")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(commit_file.torch, "save", full_disk)
    with pytest.raises(OSError, match="No space left"):
        commit_file.save({"objects": {"epoch": 3}}, str(path))
    assert commit_file.load(str(path))["objects"] == {"epoch": 2}  # the previous commit, intact
    assert sorted(p.name for p in path.parent.iterdir()) == ["state.pt"]  # no partial file left


def test_commit_file_names_a_value_it_cannot_load_safely(tmp_path):
    class Custom:
        pass

    path = tmp_path / "state.pt"
    with pytest.raises(TypeError, match=r"state\['objects'\]\['custom'\] is a Custom"):
        commit_file.save({"objects": {"epoch": 1, "custom": Custom()}}, str(path))
    assert not path.exists()


def _hvd_imports():
    """{module: the trainbridge modules it imports}, for every module under trainbridge/hvd, read with ``ast``.

    Every import counts, at the top of a module or inside a function (a function-local import
    still forms a cycle, only a hidden one).
    """
    import ast
    from pathlib import Path

    package = Path(__file__).resolve().parents[1] / "trainbridge"
    names = {}
    for path in (package / "hvd").rglob("*.py"):
        parts = ["trainbridge", *path.relative_to(package).with_suffix("").parts]
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = (path, parts[-1] == "__init__")
    graph = {}
    for name, (path, is_package) in names.items():
        here = name.split(".") if is_package else name.split(".")[:-1]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here[:len(here) - (node.level - 1)] + ([node.module] if node.module else []))
                # ``from package import module`` imports the module; ``from module import name``, the module.
                found |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in names else base for alias in node.names}
        graph[name] = {target for target in found if target.startswith("trainbridge") and target != name}
    return graph


def test_hvd_imports_nothing_of_the_public_api_and_its_modules_form_no_cycle():
    graph = _hvd_imports()
    assert len(graph) > 15, sorted(graph)  # the reading found the modules
    upward = sorted(f"{module} imports {target}" for module, targets in graph.items() for target in targets
                    if target == "trainbridge.api" or target.startswith("trainbridge.api."))
    assert not upward, "trainbridge.hvd sits below the public API:\n" + "\n".join(upward)
    inside = {module: {t for t in targets if t in graph} for module, targets in graph.items()}
    cycles = []

    def visit(module, path):
        for target in sorted(inside[module]):
            if target in path:
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in done:
                visit(target, path + [target])
        done.add(module)

    done = set()
    for module in sorted(inside):
        if module not in done:
            visit(module, [module])
    assert not cycles, "import cycles inside trainbridge.hvd:\n" + "\n".join(cycles)


def test_hvd_has_the_jobs_timeout_and_its_old_variable_still_sets_it():
    import inspect

    import trainbridge
    from trainbridge.runtime.timeout import DEFAULT_TIMEOUT_S, timeout_from_environ

    assert inspect.signature(trainbridge.init).parameters["timeout"].default == DEFAULT_TIMEOUT_S == 300.0
    assert timeout_from_environ({}) == DEFAULT_TIMEOUT_S
    assert timeout_from_environ({"TRAINBRIDGE_HVD_TIMEOUT": "45"}) == 45.0
    for bad in ("0", "-3", "soon"):
        with pytest.raises(UserError, match=r"^TRAINBRIDGE_HVD_TIMEOUT="):
            timeout_from_environ({"TRAINBRIDGE_HVD_TIMEOUT": bad})
