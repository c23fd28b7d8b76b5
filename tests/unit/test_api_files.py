"""trainbridge.api.files: atomic writes, the previous file, failed writes, the background writer,
and the checks that name what cannot be saved or loaded."""
import argparse
import collections
import os
import pathlib
import struct
import threading
import time
import zipfile

import numpy
import pytest
import torch
from python_child import run_python

from trainbridge.api import files
from trainbridge.api.files import (
    BackgroundWriter,
    CorruptCheckpoint,
    atomic_save,
    host_copy,
    read_file,
    save_all,
    state_mismatch,
    unloadable_value,
)
from trainbridge.errors import UserError

Pair = collections.namedtuple("Pair", "first second")


def saved(value: int) -> dict:
    return {"weights": torch.full((3, 2), float(value)), "step": value, "name": f"v{value}",
            "nested": {"list": [torch.arange(value + 1), 1.5, None], "tuple": (True, "x")}}


def assert_holds(path, value: int) -> None:
    loaded = torch.load(path, weights_only=True)  # what every reader of these files does
    expected = saved(value)
    assert torch.equal(loaded["weights"], expected["weights"]) and loaded["step"] == value
    assert loaded["name"] == expected["name"] and loaded["nested"]["tuple"] == (True, "x")
    assert torch.equal(loaded["nested"]["list"][0], expected["nested"]["list"][0])


def files_in(directory) -> list:
    return sorted(os.listdir(directory))  # temporary files start with a dot: listed too


# ----- atomic_save and read_file ----------------------------------------------------------------
def test_a_saved_dict_reads_back_with_weights_only_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "sub" / "last.pt"  # the folder is created
    atomic_save(saved(3), str(path))
    assert_holds(path, 3)
    loaded = read_file(str(path))
    assert loaded["nested"]["list"][1:] == [1.5, None] and loaded["weights"].device.type == "cpu"
    assert files_in(path.parent) == ["last.pt"]


def test_keep_previous_rotates_the_replaced_file(tmp_path):
    last, previous = tmp_path / "last.pt", tmp_path / "previous.pt"
    atomic_save(saved(1), str(last), keep_previous=str(previous))
    assert files_in(tmp_path) == ["last.pt"]  # nothing to rotate yet
    atomic_save(saved(2), str(last), keep_previous=str(previous))
    atomic_save(saved(3), str(last), keep_previous=str(previous))
    assert_holds(last, 3)
    assert_holds(previous, 2)
    assert files_in(tmp_path) == ["last.pt", "previous.pt"]


def test_save_all_writes_the_same_file_to_every_path(tmp_path):
    paths = [str(tmp_path / "last.pt"), str(tmp_path / "copy" / "x.pt")]
    os.makedirs(tmp_path / "copy")
    save_all(saved(4), paths)
    assert (tmp_path / "last.pt").read_bytes() == (tmp_path / "copy" / "x.pt").read_bytes()


def test_a_copy_into_a_folder_deleted_while_the_job_ran_says_so(tmp_path):
    atomic_save(saved(1), str(tmp_path / "last.pt"))
    with pytest.raises(UserError, match=rf"^cannot write the checkpoint {tmp_path / 'gone' / 'best.pt'}: "
                                        rf"{tmp_path / 'gone'} no longer exists \(deleted while the job ran\?\); "
                                        rf"nothing was written; create it again or save to another folder$"):
        files.atomic_copy(str(tmp_path / "last.pt"), str(tmp_path / "gone" / "best.pt"))


def test_a_write_where_the_parent_is_a_file_is_one_line_and_creates_nothing(tmp_path):
    (tmp_path / "a_file").write_text("not a folder")
    # os.makedirs says "File exists" here; the line names the path, says nothing changed, and the fix.
    with pytest.raises(UserError, match=r"cannot write the checkpoint .*a_file/last\.pt: .*; the checkpoints "
                                        r"already in .*a_file are unchanged; .*save to another folder"):
        atomic_save(saved(1), str(tmp_path / "a_file" / "last.pt"))
    assert files_in(tmp_path) == ["a_file"]


def test_a_path_that_is_a_directory_is_refused_before_anything_is_written(tmp_path):
    (tmp_path / "last.pt").mkdir()
    atomic_save(saved(1), str(tmp_path / "previous.pt"))
    with pytest.raises(UserError, match="is an existing directory, not a file"):
        atomic_save(saved(2), str(tmp_path / "previous.pt"), keep_previous=str(tmp_path / "last.pt"))
    assert_holds(tmp_path / "previous.pt", 1)
    assert files_in(tmp_path) == ["last.pt", "previous.pt"]


def test_an_unpicklable_value_leaves_the_old_file_and_no_temporary_file(tmp_path):
    last, previous = tmp_path / "last.pt", tmp_path / "previous.pt"
    atomic_save(saved(1), str(last), keep_previous=str(previous))
    with pytest.raises(UserError, match="a value in it cannot be pickled"):
        atomic_save({"fn": lambda: 0}, str(last), keep_previous=str(previous))
    assert_holds(last, 1)
    assert files_in(tmp_path) == ["last.pt"]  # not rotated either


def test_a_write_cut_by_the_file_size_limit_leaves_both_files_and_no_temporary_file(tmp_path):
    # RLIMIT_FSIZE makes write() fail with EFBIG (root ignores permissions, not this limit).
    result = run_python(f"""
        import resource, signal, torch
        from trainbridge.api.files import atomic_save
        from trainbridge.errors import UserError
        last, previous = {str(tmp_path / "last.pt")!r}, {str(tmp_path / "previous.pt")!r}
        atomic_save({{"v": torch.zeros(4)}}, last, keep_previous=previous)
        atomic_save({{"v": torch.ones(4)}}, last, keep_previous=previous)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an error from write(), not death by SIGXFSZ
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
        try:
            atomic_save({{"v": torch.zeros(1 << 20)}}, last, keep_previous=previous)
        except UserError as exc:
            print(exc)
    """)
    assert result.returncode == 0, result
    assert "cannot write the checkpoint" in result.stdout and "File too large" in result.stdout, result.stdout
    assert "free space there or save to another folder" in result.stdout
    assert files_in(tmp_path) == ["last.pt", "previous.pt"]
    assert torch.equal(torch.load(tmp_path / "last.pt", weights_only=True)["v"], torch.ones(4))
    assert torch.equal(torch.load(tmp_path / "previous.pt", weights_only=True)["v"], torch.zeros(4))


def test_read_file_names_a_missing_file_and_what_to_do(tmp_path):
    with pytest.raises(UserError, match=r"checkpoint .*none\.pt does not exist; use --resume never"):
        read_file(str(tmp_path / "none.pt"), missing="use --resume never")


def test_read_file_tells_a_truncated_file_from_one_holding_a_refused_type(tmp_path):
    atomic_save(saved(1), str(tmp_path / "whole.pt"))
    data = (tmp_path / "whole.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[:len(data) // 2])
    with pytest.raises(CorruptCheckpoint, match=r"cut\.pt is corrupt or truncated .*; delete it"):
        read_file(str(tmp_path / "cut.pt"))
    torch.save({"args": argparse.Namespace(lr=0.1)}, tmp_path / "namespace.pt")
    with pytest.raises(UserError, match="is intact but holds a value torch.load") as refused:
        read_file(str(tmp_path / "namespace.pt"))
    assert not isinstance(refused.value, CorruptCheckpoint)  # never set aside as corrupt


def flip_bit(path, record: str, byte: int = 0, bit: int = 0) -> None:
    """Flip one bit of the zip record whose name ends with ``record`` (a tensor's bytes: ``data/0``) in place."""
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(record))
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)  # the local header's name and extra-field lengths
        name_length, extra_length = struct.unpack("<HH", f.read(4))
        f.seek(info.header_offset + 30 + name_length + extra_length + byte)
        value = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([value ^ (1 << bit)]))


@pytest.mark.parametrize("bit", [0, 30], ids=["mantissa", "exponent"])
def test_a_bit_flipped_in_a_tensor_is_found_before_the_file_is_used(tmp_path, bit):
    path = tmp_path / "last.pt"
    atomic_save(saved(2), str(path))
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None  # every record carries its CRC-32: unzip -t passes
    flip_bit(path, "data/0", byte=bit // 8, bit=bit % 8)
    assert not torch.equal(torch.load(path, weights_only=True)["weights"], saved(2)["weights"])  # torch sees nothing
    with pytest.raises(CorruptCheckpoint, match=r"last\.pt is corrupt: its record archive/data/0 does not match the "
                                                r"CRC-32 written with it \(a bit changed on disk or in transit\); "
                                                r"delete it or load another file"):
        read_file(str(path))


def test_a_file_without_crcs_from_an_earlier_release_still_loads(tmp_path):
    from torch.utils.serialization import config

    with config.patch({"save.compute_crc32": False}):
        torch.save(saved(3), tmp_path / "old.pt")
    assert read_file(str(tmp_path / "old.pt"))["step"] == 3


# ----- BackgroundWriter -------------------------------------------------------------------------
def test_background_writes_land_in_order_and_rotate_the_right_file(tmp_path):
    writer = BackgroundWriter()
    last, previous = str(tmp_path / "last.pt"), str(tmp_path / "previous.pt")
    for value in range(1, 6):
        writer.submit(saved(value), [last], keep_previous=previous)
    writer.wait()
    assert_holds(last, 5)
    assert_holds(previous, 4)
    assert files_in(tmp_path) == ["last.pt", "previous.pt"]


def test_a_background_write_saves_the_state_as_it_was_at_submit(tmp_path, monkeypatch):
    release = threading.Event()

    def held_back(*args, **kwargs):  # the thread writes only once training has moved on
        release.wait(30)
        save_all(*args, **kwargs)

    monkeypatch.setattr(files, "save_all", held_back)
    weights = torch.zeros(1000)
    writer = BackgroundWriter()
    writer.submit({"w": weights}, [str(tmp_path / "a.pt")])
    weights.add_(1)  # training goes on while the thread writes
    release.set()
    writer.wait()
    assert torch.equal(torch.load(tmp_path / "a.pt", weights_only=True)["w"], torch.zeros(1000))


def test_start_runs_one_write_at_a_time_in_order():
    writer, events = BackgroundWriter(), []

    def write(name, seconds):
        def run():
            events.append(f"{name} start")
            time.sleep(seconds)
            events.append(f"{name} end")
        return run

    writer.start(write("first", 0.3))
    writer.start(write("second", 0))  # waits for the first
    assert events[:2] == ["first start", "first end"]
    writer.wait()
    assert events == ["first start", "first end", "second start", "second end"]
    assert writer._thread is None and threading.active_count() >= 1


def test_a_failed_background_write_raises_its_one_line_from_wait_once(tmp_path):
    (tmp_path / "a_file").write_text("")
    writer = BackgroundWriter()
    writer.submit(saved(1), [str(tmp_path / "a_file" / "last.pt")])  # returns: the write fails on the thread
    with pytest.raises(UserError, match=r"cannot write the checkpoint .*a_file/last\.pt: "):
        writer.wait()
    writer.wait()  # handed over once
    writer.submit(saved(2), [str(tmp_path / "a_file" / "x.pt")])
    with pytest.raises(UserError, match=r"x\.pt"):
        writer.submit(saved(3), [str(tmp_path / "ok.pt")])  # the next submit raises the previous error first
    assert not (tmp_path / "ok.pt").exists()


def test_submit_refuses_a_directory_at_the_call(tmp_path):
    (tmp_path / "last.pt").mkdir()
    with pytest.raises(UserError, match="is an existing directory"):
        BackgroundWriter().submit(saved(1), [str(tmp_path / "last.pt")])


# ----- host_copy, unloadable_value, state_mismatch ----------------------------------------------
def test_host_copy_copies_tensors_and_keeps_the_containers_types():
    weights = torch.ones(3, requires_grad=True)
    original = {"w": weights, "pair": Pair(torch.zeros(2), "label"), "list": [torch.ones(1)], "tuple": (1, 2),
                "plain": 7}
    copy = host_copy(original)
    assert type(copy["pair"]) is Pair and copy["pair"].second == "label"
    assert type(copy["list"]) is list and copy["tuple"] == (1, 2) and copy["plain"] == 7
    assert not copy["w"].requires_grad
    with torch.no_grad():
        weights.add_(1)
    original["pair"].first.add_(1)
    assert torch.equal(copy["w"], torch.ones(3)) and torch.equal(copy["pair"].first, torch.zeros(2))
    assert copy["w"].untyped_storage().data_ptr() != weights.untyped_storage().data_ptr()


def test_unloadable_value_is_none_for_what_weights_only_reads():
    assert unloadable_value({"t": torch.ones(2), "n": [1, 2.0, "s", None, True, b"b"], 3: (torch.float32, {1, 2}),
                             "size": torch.Size([2]), "device": torch.device("cpu")}) is None


@pytest.mark.parametrize("value, where, kind", [
    ({"a": [1, numpy.float64(2)]}, "['a'][1]", "numpy.float64"),
    ({"args": argparse.Namespace(lr=0.1)}, "['args']", "argparse.Namespace"),
    ({"pair": Pair(1, 2)}, "['pair']", f"{__name__}.Pair"),
    ({"out": pathlib.Path("/tmp")}, "['out']", "pathlib."),
    ({"fn": len}, "['fn']", "builtins.builtin_function_or_method"),
    ({pathlib.Path("/k"): 1}, " key", "pathlib."),
])
def test_unloadable_value_names_where_and_what(value, where, kind):
    problem = unloadable_value(value)
    assert problem is not None and problem.startswith(where) and f"holds a {kind}" in problem, problem
    torch.save(value, "/dev/null")  # torch.save writes each of them: only loading would fail


def test_state_mismatch_is_none_when_the_state_fits():
    model = torch.nn.Linear(2, 3)
    assert state_mismatch(model, torch.nn.Linear(2, 3).state_dict()) is None


def test_state_mismatch_names_missing_unexpected_and_misshaped_keys():
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    state = dict(model.state_dict())
    del state["1.bias"]
    state["0.weight"] = torch.zeros(4, 2)
    state["extra"] = torch.zeros(1)
    assert state_mismatch(model, state) == ("missing keys: 1.bias; unexpected keys: extra; "
                                            "shape mismatches: 0.weight")


def test_state_mismatch_shortens_a_long_list():
    model = torch.nn.Sequential(*[torch.nn.Linear(1, 1) for _ in range(5)])  # ten keys
    assert state_mismatch(model, {}).startswith(
        "missing keys: 0.weight, 0.bias, 1.weight, 1.bias, 2.weight, 2.bias (+4 more); unexpected keys: none")
