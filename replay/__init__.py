"""Paired replay: arms from git revisions, schedule, graph fingerprints, raw output."""
import os

# Before torch loads: CPU tensors of 2 MB and more get transparent huge pages. Each arm holds its own
# copy of the weights; with 4 KB pages, where a copy happened to land made identical arms differ by a
# few percent on CPU (A/A offsets of -4..+4%, sign following the build order). No effect on GPU memory.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
