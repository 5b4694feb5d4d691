"""Where a pytest run's time went, per test module, from its JUnit report (scripts/test.sh
writes one): the modules by seconds, with their test counts and share of the total.

    python3 scripts/test_times.py /tmp/pagedserve-tests.xml [--top 25]
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET


def module_times(report: str) -> list[tuple[str, float, int]]:
    """(module path, seconds, tests) by seconds, largest first; a module's seconds include its
    fixtures' setup and teardown, as pytest times them into its tests."""
    seconds: dict[str, float] = collections.defaultdict(float)
    counts: collections.Counter[str] = collections.Counter()
    for case in ET.parse(report).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        while module and module[-1][:1].isupper():  # a test class: its module is the rest
            module.pop()
        path = "/".join(module) + ".py"
        seconds[path] += float(case.get("time") or 0)
        counts[path] += 1
    return sorted(((m, s, counts[m]) for m, s in seconds.items()), key=lambda row: -row[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    rows = module_times(args.report)
    total = sum(s for _m, s, _n in rows) or 1.0
    wall = sum(float(suite.get("time") or 0) for suite in ET.parse(args.report).getroot().iter("testsuite"))
    print(f"{'seconds':>8} {'share':>6} {'tests':>5}  module (of {total:.0f} s in {len(rows)} modules; "
          f"{wall:.0f} s wall)")
    for module, s, n in rows[:args.top]:
        print(f"{s:8.1f} {s / total:6.1%} {n:5d}  {module}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
