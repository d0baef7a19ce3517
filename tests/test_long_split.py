"""conftest.LONG (the checks `make test` leaves to `make test-long`) names only tests that
exist: each file, and each test function of a node id, is found in tests/ (a renamed test
would otherwise drop silently back into make test, or out of both lists' sight)."""

import os
import re

import conftest

HERE = os.path.dirname(os.path.abspath(__file__))


def test_every_long_entry_names_an_existing_test():
  missing = []
  for entry, reason in conftest.LONG.items():
    assert reason.strip(), f"{entry}: say why it is long"
    file, _, node = entry.partition("::")
    path = os.path.join(HERE, file)
    if not os.path.isfile(path):
      missing.append(entry)
      continue
    if node:
      name = node.split("[")[0]
      with open(path, encoding="utf-8") as f:
        if not re.search(rf"^def {re.escape(name)}\(", f.read(), re.M):
          missing.append(entry)
  assert not missing, f"conftest.LONG names tests that do not exist: {missing}"
