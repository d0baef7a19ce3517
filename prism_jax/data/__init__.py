"""prism_jax.data: sources -> tokenizer -> packed rows with example ids -> grain batches.

  packed = prepare_data(cfg.data, cfg.model.vocab_size, workdir)   # packs once, reuses
  loader = make_loader(packed, "train", global_batch, seed, process_index, process_count)
  batch = loader.batch_at(step)            # pure function of (seed, step)
  for batch in loader.resume(state): ...   # state = loader.state(next_step)
  packed.snippet(example_id, offset)       # the training text around a token
"""

from prism_jax.data.packed import PackedData, prepare_data, run_tokenizer
from prism_jax.data.pack_format import OldPackError
from prism_jax.data.packing import pack, pack_config
from prism_jax.data.sources import (DEFAULT_CORPUS, Document, iter_documents, load_documents,
                                    resolve_paths, source_hash)
from prism_jax.data.tokenizers import (BpeTokenizer, ByteTokenizer, Tokenizer, load_tokenizer,
                                       make_tokenizer, train_bpe)

_PIPELINE = ("DataState", "Loader", "PackedRows", "make_loader", "row_to_example")


def __getattr__(name):
  """The grain pipeline loads on first use: importing grain (and jax) takes seconds, which a
  packing worker process, which needs neither, should not pay."""
  if name in _PIPELINE:
    from prism_jax.data import pipeline  # pylint: disable=g-import-not-at-top  (deferred: grain and jax)
    return getattr(pipeline, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BpeTokenizer", "ByteTokenizer", "DEFAULT_CORPUS", "DataState", "Document", "Loader",
    "OldPackError",
    "PackedData", "PackedRows", "Tokenizer", "iter_documents", "load_documents",
    "load_tokenizer", "make_loader", "make_tokenizer", "pack", "pack_config",
    "prepare_data", "resolve_paths", "row_to_example", "run_tokenizer", "source_hash",
    "train_bpe",
]
