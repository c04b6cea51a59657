"""The tags in tracekit/tags.py are what the reference trainer's collectives carry: a label moved
or a trainer function renamed (its qualified name is the tag where no label is open) fails here rather than
silently moving bytes between the exchange, the sync and the dense all-reduce in every analysis.
A recorded run's tags are checked against them in tests/test_costmodel.py."""

from __future__ import annotations

import inspect

from tracekit import tags
from tracekit.dlrm import compression, output_codec, replicas, sharding, train


def test_the_exchange_calls_are_labelled_with_their_roles() -> None:
    """The input dist labels its two calls (lengths, then ids); the output dist's calls carry
    output_fwd / output_bwd, through a codec labels of their own; the tags of runs recorded before
    stay the names of the functions that issued them then."""
    names = sharding.ShardedEmbeddings._input_dist.__code__.co_names
    assert {"label", "INPUT_LENGTHS", "INPUT_IDS"} <= set(names)
    assert names.index("INPUT_LENGTHS") < names.index("INPUT_IDS")
    assert inspect.signature(sharding.exchange_rows).parameters["labels"].default == (tags.OUTPUT_FWD, tags.OUTPUT_BWD)
    for method, label in (("forward", "OUTPUT_FWD_CODED"), ("backward", "OUTPUT_BWD_CODED")):
        assert {"label", label} <= set(getattr(output_codec._CodedAllToAll, method).__code__.co_names)
    assert tags.EXCHANGE == (tags.INPUT_LENGTHS, tags.INPUT_IDS, tags.OUTPUT_FWD, tags.OUTPUT_BWD)
    assert len({*tags.EXCHANGE, tags.OUTPUT_FWD_CODED, tags.OUTPUT_BWD_CODED}) == 6
    assert tags.LEGACY_INPUT_DIST == "ShardedEmbeddings._input_dist"
    assert tags.LEGACY_OUTPUT == {"_AllToAll.forward": tags.OUTPUT_FWD, "_AllToAll.backward": tags.OUTPUT_BWD,
                                  "_CodedAllToAll.forward": tags.OUTPUT_FWD_CODED,
                                  "_CodedAllToAll.backward": tags.OUTPUT_BWD_CODED}
    assert train._sum_allreduce_hook.__qualname__ == tags.DENSE_ALLREDUCE


def test_the_trainer_labels_are_the_tags() -> None:
    assert replicas.SYNC_LABEL == tags.REPLICA_SYNC
    assert compression.LABEL == tags.DCT_DP
    assert all(tag.startswith(tags.SYNC_TAGS) for tag in (tags.REPLICA_SYNC, tags.TIER2_SYNC))
