"""`with tracekit.sources(counts):` which rank each item of the embedding lookups in a block came from.

A model-parallel trainer looks up, on a table's owner, the items every rank sent it, joined in rank
order. Declared, each recorded lookup of such a call gets the rank its item came from (`lookups.src`)
and the item's index among those that rank sent (`lookups.src_sample`), so the analyses join where
they would otherwise rebuild the exchange from the all-to-all's splits. An item is what `sample`
counts in the call: a bag of an EmbeddingBag call, a row of a 2-D input, or one id of a 1-D
nn.Embedding input (whose `src_sample` stays null: the id's sample is not in the call).

    with tracekit.sources([b0, b1]):        # b0 bags from rank 0, then b1 from rank 1
        pooled = shard(ids, offsets)
    with tracekit.sources([n0, n1], ranks=[2, 3]):  # the exchange ran over ranks 2 and 3
        rows = seq_shard(ids)

The declaration holds for the block's calls on this thread (a ContextVar, like `tracekit.label`); a
call whose items do not number `sum(counts)` records nulls. Untraced, it only checks its arguments.
"""

from __future__ import annotations

import functools
import numbers
from contextvars import ContextVar, Token
from typing import NamedTuple, Sequence


class Sources(NamedTuple):
    """A block's declaration: `counts[q]` items came from global rank `ranks[q]`, in that order."""

    counts: tuple[int, ...]
    ranks: tuple[int, ...]


current_sources: ContextVar[Sources | None] = ContextVar("tracekit_sources", default=None)


def _ints(name: str, values: Sequence[int]) -> tuple[int, ...]:
    """`values` as a tuple of non-negative ints; TypeError/ValueError naming `name` otherwise."""
    if type(values) in (list, tuple) and (not values or set(map(type, values)) == {int} and min(values) >= 0):
        return tuple(values)  # the common case, in C: a trainer declares once per table call
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"tracekit.sources: `{name}` must be a sequence of non-negative ints such as [64, 64], "
                        f"got {type(values).__name__}")
    for q, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"tracekit.sources: `{name}`[{q}] must be an int, got {type(value).__name__} {value!r}")
        if value < 0:
            raise ValueError(f"tracekit.sources: `{name}`[{q}] must be >= 0, got {value}")
    return tuple(int(value) for value in values)


@functools.cache
def _positions(n: int) -> tuple[int, ...]:
    return tuple(range(n))


class sources:
    """Declare that the embedding lookups in this block look up items received from ranks 0..len(counts)-1
    in rank order, `counts[q]` of them from rank q; `ranks` (default: the positions themselves) names the
    global rank of each position where the exchange ran over a subgroup. A class rather than a generator
    context manager: a trainer enters one per table call, and this is the cheaper of the two."""

    __slots__ = ("_sources", "_token")

    def __init__(self, counts: Sequence[int], *, ranks: Sequence[int] | None = None) -> None:
        counts = _ints("counts", counts)
        if ranks is None:
            ranks = _positions(len(counts))
        else:
            ranks = _ints("ranks", ranks)
            if len(ranks) != len(counts):
                raise ValueError(f"tracekit.sources: `ranks` names {len(ranks)} ranks for {len(counts)} `counts`; "
                                 "give one global rank per count")
        self._sources = Sources(counts, ranks)
        self._token: Token | None = None

    def __enter__(self) -> Sources:
        self._token = current_sources.set(self._sources)
        return self._sources

    def __exit__(self, *exc: object) -> None:
        current_sources.reset(self._token)
