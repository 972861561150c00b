"""Which tests the C++ builds of a test run went to: the run's `cxx-calls.log` (tools/cxx_cache.py) read with its
`test-times.log` (tests/conftest.py), a line per test with its builds, their seconds and its kept builds reused.

    python tools/cxx_builds_by_test.py /tmp/pytest-of-$USER/pytest-current

A build is the test's that ran in the same test process when the build ended; one made after every test of its
process ended (a background child finishing late) is the process's last test's. On a fresh machine (or with
ACCEL_TEST_CXX_CACHE=run) every kernel the suite needs is built once: the misses are what a fresh machine pays.
"""
from __future__ import annotations

import argparse
import bisect
from collections import defaultdict
from pathlib import Path


def read_times(path: Path) -> dict[str, list[tuple[float, float, str]]]:
    """{test process: [(start, end, test)] by start}."""
    runs = defaultdict(list)
    for line in path.read_text().splitlines():
        start, end, worker, test = line.split(" ", 3)
        runs[worker].append((float(start), float(end), test))
    return {worker: sorted(tests) for worker, tests in runs.items()}


def test_at(tests: list[tuple[float, float, str]], when: float) -> str:
    index = bisect.bisect_right([start for start, _, _ in tests], when) - 1
    return tests[max(index, 0)][2] if tests else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="the run's folder: pytest's base temporary folder")
    args = parser.parse_args()
    times = read_times(args.run_dir / "test-times.log")
    builds = defaultdict(lambda: [0, 0.0, 0])  # test: [misses, their seconds, hits]
    for line in (args.run_dir / "cxx-calls.log").read_text().splitlines():
        fields = line.split()
        if len(fields) < 5:
            continue  # a line of a log written before the worker and time were
        seconds = float(fields[1]) if fields[0] == "miss" else 0.0
        worker, when = fields[-2], float(fields[-1])
        test = test_at(times.get(worker, []), when) if worker in times else fields[-3]
        row = builds[test]
        if fields[0] == "miss":
            row[0] += 1
            row[1] += seconds
        else:
            row[2] += 1
    print(f"{'builds':>6} {'seconds':>8} {'reused':>6}  test")
    for test, (misses, seconds, hits) in sorted(builds.items(), key=lambda kv: -kv[1][1]):
        print(f"{misses:6d} {seconds:8.1f} {hits:6d}  {test}")
    total = [sum(row[i] for row in builds.values()) for i in range(3)]
    print(f"{total[0]:6d} {total[1]:8.1f} {total[2]:6d}  (all)")


if __name__ == "__main__":
    main()
