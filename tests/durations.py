"""How long each test took in a measured run of the suite (`durations.json`), used to hand the
heaviest xdist groups out first.

pytest-xdist's `--dist loadgroup` gives each worker one group at a time, in the order the
groups reach its scheduler: left to itself it sorts them by test count, so a group of one
half-minute test (a server start, a compile) can be handed out last and run alone while the
other worker idles. `tests/conftest.py` turns that sort off and orders the collection by group
weight instead (longest first, the classic rule for two machines), using these figures.

The figures only order the suite; no test reads them. Refresh them after a change that moves a
test's time by much: run the suite with `--durations=0` into a log, then
`python -m tests.durations LOG`.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

FILE = Path(__file__).with_name("durations.json")
# A test the file does not name (new since the last refresh) weighs this much.
DEFAULT_S = 0.05
# Tests under this are left out of the file (the default stands for them): most of the
# suite takes a few milliseconds.
RECORD_FROM_S = 0.2
_LINE = re.compile(r"^([\d.]+)s (?:call|setup|teardown) +(\S+)$")


def load() -> dict[str, float]:
    """The recorded seconds per test id (without the xdist group suffix); {} with no file."""
    try:
        return json.loads(FILE.read_text())
    except FileNotFoundError:
        return {}


def parse_report(text: str) -> dict[str, float]:
    """Seconds per test id (setup, call and teardown summed) from pytest's `--durations`
    report; the `@group` suffix pytest-xdist adds to ids is dropped."""
    seconds: dict[str, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if m:
            nodeid = m.group(2).split("@", 1)[0]
            seconds[nodeid] = round(seconds.get(nodeid, 0.0) + float(m.group(1)), 2)
    return seconds


def heaviest_groups_first(items: Sequence[Any], groups: dict[str, str],
                          seconds: dict[str, float]) -> list[Any]:
    """`items` reordered group by group, the group with the most recorded seconds first;
    within a group (and between groups of equal weight) the collection's order stays."""
    weight: dict[str, float] = {}
    first: dict[str, int] = {}
    for k, item in enumerate(items):
        group = groups[item.nodeid]
        weight[group] = weight.get(group, 0.0) + seconds.get(item.nodeid, DEFAULT_S)
        first.setdefault(group, k)
    rank = {g: r for r, g in enumerate(sorted(weight, key=lambda g: (-weight[g], first[g])))}
    return sorted(items, key=lambda item: rank[groups[item.nodeid]])


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.durations LOG  (a suite run's `--durations=0` output)")
        return 2
    seconds = parse_report(Path(argv[0]).read_text())
    kept = {k: v for k, v in sorted(seconds.items()) if v >= RECORD_FROM_S}
    FILE.write_text(json.dumps(kept, indent=0) + "\n")
    print(f"{len(kept)} tests of {len(seconds)} recorded in {FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
