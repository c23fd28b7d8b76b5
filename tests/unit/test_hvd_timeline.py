"""Horovod's timeline written by a one-rank job in the test process, read back as JSON."""
import json

import torch
from one_rank_hvd import hvd_job

import trainbridge.hvd as hvd


def events_of(path):
    """(operation name -> [(phase, name or args)]) and the CYCLE_START marks, from a timeline file."""
    events = json.loads(path.read_text())  # valid JSON: Horovod's file ends in "]" after every write
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"
             and "name" in e["args"]}
    by_op = {}
    for e in events:
        if e["ph"] in "BEX":
            by_op.setdefault(names[e["pid"]], []).append((e["ph"], e.get("name", e.get("args"))))
    assert [e["ts"] for e in events if "ts" in e] == sorted(e["ts"] for e in events if "ts" in e)
    return by_op, [e for e in events if e["ph"] == "i"]


def test_the_timeline_has_horovods_events_for_each_operation(tmp_path):
    path = tmp_path / "timeline.json"
    with hvd_job(HOROVOD_TIMELINE=str(path)) as engine:
        with engine._cv:  # both in one cycle: fused
            a = hvd.allreduce_async(torch.ones(4, 3), name="grad.a")
            b = hvd.allreduce_async(torch.ones(5), name="grad.b")
        hvd.synchronize(a), hvd.synchronize(b)
        hvd.broadcast(torch.ones(3, dtype=torch.float64), root_rank=0, name="weights")
        hvd.allgather(torch.ones(2, 2))
    by_op, marks = events_of(path)
    negotiation = [("B", "NEGOTIATE_ALLREDUCE"), ("X", "0"), ("E", None)]
    assert by_op["allreduce.grad.a"] == negotiation + [
        ("B", "ALLREDUCE"), ("B", "QUEUE"), ("E", None), ("B", "MEMCPY_IN_FUSION_BUFFER"), ("E", None),
        ("B", "GLOO_ALLREDUCE"), ("E", None), ("B", "MEMCPY_OUT_FUSION_BUFFER"), ("E", None),
        ("E", {"dtype": "float32", "shape": "[4, 3]"})]
    assert by_op["allreduce.grad.b"][-1] == ("E", {"dtype": "float32", "shape": "[5]"})
    assert by_op["broadcast.weights"] == [("B", "NEGOTIATE_BROADCAST"), ("X", "0"), ("E", None), ("B", "BROADCAST"),
                                          ("B", "QUEUE"), ("E", None), ("B", "GLOO_BCAST"), ("E", None),
                                          ("E", {"dtype": "float64", "shape": "[3]"})]
    assert by_op["allgather.noname.1"][-3:] == [("B", "GLOO_ALLGATHER"), ("E", None),
                                                ("E", {"dtype": "float32", "shape": "[2, 2]"})]
    assert not marks


def test_start_and_stop_timeline_switch_files_and_mark_cycles(tmp_path):
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    with hvd_job(HOROVOD_TIMELINE="DYNAMIC"):
        hvd.allreduce(torch.ones(1), name="unrecorded")
        hvd.start_timeline(str(first))
        hvd.allreduce(torch.ones(1), name="in_first")
        hvd.start_timeline(str(second), mark_cycles=True)  # closes the first
        hvd.allreduce(torch.ones(1), name="in_second")
        hvd.stop_timeline()
        hvd.stop_timeline()  # nothing open: nothing happens, as in Horovod
        hvd.allreduce(torch.ones(1), name="after_stop")
    assert list(events_of(first)[0]) == ["allreduce.in_first"]
    ops, marks = events_of(second)
    assert list(ops) == ["allreduce.in_second"] and marks and all(m["name"] == "CYCLE_START" for m in marks)


def test_the_fusion_threshold_and_group_fusion_show_in_the_timeline(tmp_path):
    def fused(path, **variables):
        with hvd_job(HOROVOD_TIMELINE=str(path), **variables) as engine:
            with engine._cv:  # one cycle
                handles = [hvd.grouped_allreduce_async([torch.ones(2), torch.ones(2)], name="group"),
                           hvd.allreduce_async(torch.ones(2), name="alone")]
            for handle in handles:
                hvd.synchronize(handle)
        ops, _ = events_of(path)
        return {name: ("B", "MEMCPY_IN_FUSION_BUFFER") in events for name, events in ops.items()}

    assert fused(tmp_path / "default.json") == {"allreduce.group": True, "allreduce.alone": True}
    assert fused(tmp_path / "none.json", HOROVOD_FUSION_THRESHOLD="0") == {"allreduce.group": False,
                                                                          "allreduce.alone": False}
    assert fused(tmp_path / "apart.json", HOROVOD_DISABLE_GROUP_FUSION="1") == {"allreduce.group": True,
                                                                               "allreduce.alone": False}
