"""The tags in tracekit/tags.py are what the reference trainer's collectives carry: a trainer
function renamed (its qualified name is the tag where no label is open) fails here rather than
silently moving bytes between the exchange, the sync and the dense all-reduce in every analysis.
A recorded run's tags are checked against them in tests/test_costmodel.py."""

from __future__ import annotations

from tracekit import tags
from tracekit.dlrm import compression, replicas, sharding, train


def test_the_exchange_tags_are_the_trainer_functions_qualified_names() -> None:
    assert sharding.ShardedEmbeddings._input_dist.__qualname__ == tags.INPUT_DIST
    assert sharding._AllToAll.forward.__qualname__ == tags.OUTPUT_FWD
    assert sharding._AllToAll.backward.__qualname__ == tags.OUTPUT_BWD
    assert train._sum_allreduce_hook.__qualname__ == tags.DENSE_ALLREDUCE


def test_the_trainer_labels_are_the_tags() -> None:
    assert replicas.SYNC_LABEL == tags.REPLICA_SYNC
    assert compression.LABEL == tags.DCT_DP
    assert all(tag.startswith(tags.SYNC_TAGS) for tag in (tags.REPLICA_SYNC, tags.TIER2_SYNC))
