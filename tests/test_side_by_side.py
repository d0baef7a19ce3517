"""benchmarks/side_by_side.py: what a timed `make test` printed, read back (the summary lines
below are pytest's own, copied from this repository's runs)."""

from benchmarks import side_by_side


def test_the_last_pytest_summary_line_is_read():
  out = ("bringing up nodes...\n...... [ 7%]\n"
         "=== 975 passed, 11 skipped, 8 warnings in 734.05s (0:12:14) ===\n")
  assert side_by_side.pytest_summary(out) == {"passed": 975, "skipped": 11, "pytest_s": 734.05}
  failed = ("FAILED tests/test_x.py::test_y - AssertionError\n"
            "3 failed, 972 passed, 11 skipped, 8 warnings in 817.18s (0:13:37)\n")
  assert side_by_side.pytest_summary(failed) == {"failed": 3, "passed": 972, "skipped": 11,
                                                 "pytest_s": 817.18}
  assert side_by_side.pytest_summary("make: *** [Makefile:73: test] Error 1\n") == {}
