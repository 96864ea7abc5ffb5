"""Pure decisions: eviction, prefetch stop, write policy and the load-vs-recompute cost model.

Policies see keys and numbers, never a backend or a buffer; they do no I/O, start no
threads and take an injectable clock, so each is tested exhaustively. Imports only the
layers below it.
"""
