"""The val split in two halves by document: one to choose settings on, one to report.

A setting chosen on the numbers it is reported with overstates them. The val documents are
split once, seeded, into a "choose" half and a "test" half (by document: a document's tokens
are all on one side); every choice (K, k, an option, a threshold) is made on the choose half,
and the chosen settings are measured once on the test half.

  halves = val_halves(packed, seed=0)             # {"choose": ids, "test": ids}
  loader = HalfLoader(val_loader, halves["choose"])

HalfLoader keeps the val rows but masks every target token outside its half's documents,
so an evaluator scores that half alone; it records which documents it let through
(`seen_documents`), the check that a choice never read the test half. A packed row can hold
the end of one document and the start of the next: a choose-half token may then have
test-half text in its context (the model attends across the EOS), never as a target.
"""

from __future__ import annotations

from typing import Any

import numpy as np

HALVES = ("choose", "test")


def val_halves(packed, seed: int = 0) -> dict[str, np.ndarray]:
  """The val documents (example ids) of each half: a seeded permutation cut in two
  (the choose half gets the smaller share of an odd count)."""
  ids = np.sort(np.asarray(packed.document_ids("val"), np.int64))
  if len(ids) < 2:
    raise ValueError(f"the val split has {len(ids)} document(s): two halves need at least 2 "
                     "(raise data.val_fraction or give data.val_sources)")
  perm = np.random.default_rng([seed, 0x5A1F]).permutation(len(ids))
  cut = len(ids) // 2
  return {"choose": np.sort(ids[perm[:cut]]), "test": np.sort(ids[perm[cut:]])}


class HalfLoader:
  """A one-pass val loader whose batches score only the given documents' tokens."""

  def __init__(self, loader, documents: np.ndarray):
    self._loader = loader
    self.documents = np.asarray(documents, np.int64)
    self.split = loader.split
    self.num_batches = loader.num_batches
    self.seen_documents: set[int] = set()

  def batch_at(self, i: int) -> dict[str, Any]:
    batch = dict(self._loader.batch_at(i))
    mask = np.asarray(batch["mask"], bool) & np.isin(batch["example_id"], self.documents)
    batch["mask"] = mask
    self.seen_documents.update(int(d) for d in np.unique(batch["example_id"][mask]))
    return batch
