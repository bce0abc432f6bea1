"""Runtime processes start from a fork server that imported torch once, with the parent's
environment as it is when each starts (`genserve/process_start.py`)."""

from __future__ import annotations

import os

import pytest

from genserve import process_start


def _report(conn) -> None:
    import sys

    conn.send({"pid": os.getpid(), "probe": os.environ.get("GENSERVE_PROBE"),
               "torch_before_target": "torch" in sys.modules,
               "threads": __import__("torch").get_num_threads()})
    conn.close()


def _run(ctx) -> dict:
    mine, theirs = ctx.Pipe()
    proc = process_start.run_in_process(ctx, _report, (theirs,), name="probe")
    theirs.close()
    out = mine.recv()
    proc.join(30)
    assert proc.exitcode == 0
    return out


def test_children_get_the_environment_of_their_start_not_the_servers(monkeypatch):
    ctx = process_start.process_context()
    if ctx.get_start_method() != "forkserver":
        pytest.skip("no fork server on this platform")
    monkeypatch.setenv("GENSERVE_PROBE", "first")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    first = _run(ctx)
    monkeypatch.setenv("GENSERVE_PROBE", "second")  # the fork server started before this
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    second = _run(ctx)
    assert (first["probe"], second["probe"]) == ("first", "second")
    assert (first["threads"], second["threads"]) == (1, 2)
    # Imported once in the fork server: the child had torch before its target ran.
    assert first["torch_before_target"] and second["torch_before_target"]
    assert first["pid"] != second["pid"]


def test_spawn_can_be_chosen_and_a_wrong_value_is_refused(monkeypatch):
    monkeypatch.setenv("GENSERVE_PROCESS_START", "spawn")
    ctx = process_start.process_context()
    assert ctx.get_start_method() == "spawn"
    monkeypatch.setenv("GENSERVE_PROBE", "spawned")
    out = _run(ctx)
    assert out["probe"] == "spawned" and not out["torch_before_target"]
    monkeypatch.setenv("GENSERVE_PROCESS_START", "vfork")
    with pytest.raises(ValueError, match="expected auto, spawn or forkserver"):
        process_start.process_context()
