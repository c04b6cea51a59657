"""The optional API of traced programs: no-ops when nothing traces, a label that nests."""

from __future__ import annotations

import tracekit
from tracekit.labels import current_label


def test_step_is_a_no_op_when_not_traced() -> None:
    tracekit.step(samples=3, loss=0.5)


def test_labels_nest_and_unwind() -> None:
    assert current_label.get() is None
    with tracekit.label("emb_fwd"):
        assert current_label.get() == "emb_fwd"
        with tracekit.label("inner"):
            assert current_label.get() == "inner"
        assert current_label.get() == "emb_fwd"
    assert current_label.get() is None
