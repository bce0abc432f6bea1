"""The suite's heaviest xdist groups are handed out first (tests/durations.py): with two
workers, a heavy group left for last would run alone while the other worker idles."""

from __future__ import annotations

from dataclasses import dataclass

from tests import durations


@dataclass
class Item:
    nodeid: str


def test_groups_leave_heaviest_first_and_keep_their_order():
    items = [Item("a.py::t1"), Item("b.py::t1"), Item("a.py::t2"), Item("c.py::t1"),
             Item("b.py::t2")]
    groups = {"a.py::t1": "a", "a.py::t2": "a", "b.py::t1": "b", "b.py::t2": "b",
              "c.py::t1": "c"}
    seconds = {"a.py::t1": 1.0, "b.py::t1": 30.0, "c.py::t1": 5.0}
    ordered = durations.heaviest_groups_first(items, groups, seconds)
    assert [i.nodeid for i in ordered] == ["b.py::t1", "b.py::t2", "c.py::t1", "a.py::t1",
                                           "a.py::t2"]


def test_unmeasured_tests_weigh_the_default():
    items = [Item("new.py::t1"), Item("new.py::t2"), Item("old.py::t1")]
    groups = {"new.py::t1": "new", "new.py::t2": "new", "old.py::t1": "old"}
    # Two unmeasured tests outweigh one measured at a little more than the default.
    ordered = durations.heaviest_groups_first(items, groups,
                                              {"old.py::t1": 1.5 * durations.DEFAULT_S})
    assert [i.nodeid for i in ordered][0] == "new.py::t1"


def test_the_recorded_durations_parse_from_a_pytest_report(tmp_path):
    report = tmp_path / "run.log"
    report.write_text(
        "============ slowest durations ============\n"
        "12.50s call     tests/x.py::test_a@tests/x.py\n"
        "3.00s setup    tests/x.py::test_a@tests/x.py\n"
        "0.40s call     tests/y.py::test_b[1]\n"
        "1 passed in 16.00s\n")
    assert durations.parse_report(report.read_text()) == {"tests/x.py::test_a": 15.5,
                                                          "tests/y.py::test_b[1]": 0.4}


def test_the_committed_file_holds_seconds_per_test_id():
    seconds = durations.load()
    assert seconds and all(s > 0 for s in seconds.values())
    assert all(nodeid.startswith("tests/") and "::" in nodeid for nodeid in seconds)
