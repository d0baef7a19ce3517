"""The renderers of docs/RESULTS.md, in one place: each results JSON's reader (its rows of the
paper-vs-ours table), each section's markdown, and the opening summary. Pure Python, no
flags: experiments.reproduce writes RESULTS.md with them, and the experiments and benchmarks
that print their own tables import the same functions (this package sits below both)."""
