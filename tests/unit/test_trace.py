"""The run timeline: Chrome trace events, lanes, files that survive a crash, the PNG."""

from __future__ import annotations

import asyncio
import json

import pytest

from arl.stats.trace import Tracer, load_trace, overlap_s, spans


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _tracer(tmp_path, name="trace.json"):
    clock = Clock()
    return Tracer(tmp_path / name, clock=clock), clock


def test_overlapping_spans_take_separate_lanes_and_free_them(tmp_path):
    tr, clock = _tracer(tmp_path)
    tr.declare("trainer", "rollout0")
    a = tr.span("rollout0", "generate", key="g0")
    b = tr.span("rollout0", "generate", key="g1")
    a.__enter__()
    clock.t += 1
    b.__enter__()
    clock.t += 1
    a.__exit__(None, None, None)
    with tr.span("rollout0", "generate", key="g2"):  # lane of g0 is free again
        clock.t += 0.5
    b.__exit__(None, None, None)
    tr.add("rollout0", "paused", 101.0, 101.25, lane="weights")
    tr.close()
    ss = {
        s["args"]["key"] if "args" in s and "key" in s["args"] else s["name"]: s
        for s in spans(load_trace(tmp_path / "trace.json"))
    }
    assert ss["g0"]["tid"] == ss["g2"]["tid"] != ss["g1"]["tid"]
    assert ss["paused"]["tid"] not in {ss["g0"]["tid"], ss["g1"]["tid"]}
    assert ss["g0"]["start"] == 0 and ss["g0"]["end"] == 2
    assert ss["g1"]["end"] - ss["g1"]["start"] == 1.5
    assert {s["row"] for s in ss.values()} == {"rollout0"}
    events = load_trace(tmp_path / "trace.json")
    names = {e["args"]["name"]: e["pid"] for e in events if e["name"] == "process_name"}
    assert names["trainer"] < names["rollout0"]  # declared order


def test_a_span_takes_the_lowest_lane_that_no_open_span_holds(tmp_path):
    """Lanes given back out of order are taken again lowest first; a new lane is made only when
    every lane is held, and each lane keeps its tid."""
    tr, clock = _tracer(tmp_path)
    opened = {}
    for key in ("a", "b", "c", "d"):  # lanes 0-3
        opened[key] = tr.span("r", "gen", key=key)
        opened[key].__enter__()
    for key in ("c", "a", "b"):  # lanes 2, 0, 1 given back
        clock.t += 1
        opened[key].__exit__(None, None, None)
    for key in ("e", "f", "g", "h"):  # lanes 0, 1, 2, then a new lane 4
        opened[key] = tr.span("r", "gen", key=key)
        opened[key].__enter__()
    clock.t += 1
    for key in ("d", "e", "f", "g", "h"):
        opened[key].__exit__(None, None, None)
    tr.close()
    events = load_trace(tmp_path / "trace.json")
    tid = {s["args"]["key"]: s["tid"] for s in spans(events)}
    assert (tid["e"], tid["f"], tid["g"]) == (tid["a"], tid["b"], tid["c"])
    assert len({tid[k] for k in "abcdh"}) == 5
    lane_names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert [lane_names[tid[k]] for k in "abcdh"] == [f"lane {i}" for i in range(5)]


def test_span_records_errors_and_cancellations(tmp_path):
    tr, clock = _tracer(tmp_path)

    async def main():
        with pytest.raises(ValueError), tr.span("n", "boom"):
            raise ValueError("x")

        async def slow():
            with tr.span("n", "slow"):
                await asyncio.sleep(10)

        task = asyncio.create_task(slow())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await tr.timed("n", "ok", asyncio.sleep(0, result=7)) == 7

    asyncio.run(main())
    tr.close()
    by_name = {s["name"]: s for s in spans(load_trace(tr.path))}
    assert by_name["boom"]["args"] == {"error": "ValueError"}
    assert by_name["slow"]["args"] == {"cancelled": True}
    assert "args" not in by_name["ok"]


def test_a_trace_is_plain_json_at_every_moment_without_close(tmp_path):
    tr, clock = _tracer(tmp_path)
    assert json.loads(tr.path.read_text()) == []  # a run killed before its first step
    tr.add("a", "one", 100.0, 101.0)
    tr.flush()
    assert [s["name"] for s in spans(json.loads(tr.path.read_text()))] == ["one"]
    tr.add("a", "two", 101.0, 102.0)
    tr.flush()  # the run dies here (kill -9): close() never runs
    assert [s["name"] for s in spans(json.loads(tr.path.read_text()))] == ["one", "two"]
    tr.close()
    assert [s["name"] for s in spans(json.loads(tr.path.read_text()))] == ["one", "two"]


def test_load_trace_still_reads_an_open_array(tmp_path):
    (tmp_path / "old.json").write_text('[\n{"name":"x","ph":"X","ts":0,"dur":1,"pid":1,"tid":1}')
    assert [s["name"] for s in spans(load_trace(tmp_path / "old.json"))] == ["x"]


def test_disabled_tracer_writes_nothing(tmp_path):
    tr = Tracer(None)
    with tr.span("a", "b") as args:
        args["x"] = 1
    tr.add("a", "c", 0.0, 1.0)
    tr.flush()
    tr.close()
    assert list(tmp_path.iterdir()) == []


def test_a_resumed_run_keeps_the_earlier_trace(tmp_path):
    first, _ = _tracer(tmp_path)
    first.add("a", "before", 100.0, 101.0)
    first.close()
    second, _ = _tracer(tmp_path)
    second.add("a", "after", 100.0, 101.0)
    second.close()
    assert [s["name"] for s in spans(load_trace(tmp_path / "trace.1.json"))] == ["before"]
    assert [s["name"] for s in spans(load_trace(tmp_path / "trace.json"))] == ["after"]


def test_load_trace_rejects_what_is_not_a_trace(tmp_path):
    (tmp_path / "empty.json").write_text("")
    (tmp_path / "obj.json").write_text('{"a": 1}')
    with pytest.raises(ValueError, match="empty"):
        load_trace(tmp_path / "empty.json")
    with pytest.raises(ValueError, match="no list of trace events"):
        load_trace(tmp_path / "obj.json")


def test_overlap_counts_time_covered_by_both_sides():
    def s(a, b):
        return {"start": a, "end": b}

    gen = [s(0, 2), s(1, 3), s(10, 11)]  # merged: [0, 3], [10, 11]
    train = [s(2.5, 4), s(10.5, 12)]
    assert overlap_s(gen, train) == pytest.approx(0.5 + 0.5)
    assert overlap_s(gen, [s(4, 9)]) == 0.0


def test_png_of_two_traces(tmp_path):
    pytest.importorskip("matplotlib")
    from arl.stats.trace_png import main

    paths = []
    for i in range(2):
        tr, clock = _tracer(tmp_path, f"t{i}.json")
        tr.declare("trainer", "rollout0", "train0")
        tr.add("trainer", "wait_rollout", 100.0, 101.0)
        with tr.span("rollout0", "generate"):
            clock.t += 1
        tr.add("train0", "ppo_update", 101.0, 102.0)
        tr.close()
        paths.append(str(tr.path))
    out = tmp_path / "timeline.png"
    assert main([*paths, "--labels", "eta=0", "eta=2", "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([*paths, "--labels", "only-one", "-o", str(out)]) == 2
    assert main([str(tmp_path / "missing.json"), "-o", str(out)]) == 2
