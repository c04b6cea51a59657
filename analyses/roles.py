"""Which collective of the embedding exchange each recorded call is: the `role` column of `comms`
(and `train_comms`), one of tracekit.tags.EXCHANGE (input_lengths, input_ids, output_fwd,
output_bwd), null for every other call. The one place an analysis learns a call's role from:

- a call the reference trainer labelled (tracekit/dlrm/sharding.py, output_codec.py): ROLE of its tag;
- a run recorded before the trainer labelled them: the first two calls tagged tracekit.tags.
  LEGACY_INPUT_DIST of a (rank, step, phase), in `seq` order, are the lengths then the ids; a call
  tagged with a key of tags.LEGACY_OUTPUT has the role of the label it stands for;
- a (rank, step, phase) whose calls carry none of those tags (a TorchRec run, whose calls cannot
  be labelled): its all-to-alls, TorchRec's all-to-all of split sizes (tags.TORCHREC_SPLITS)
  aside, when they are four, in `seq` order (the input dist's lengths and ids, the output dist's
  forward and backward of one sharding group); a step with more (several sharding groups) or
  fewer is left without roles.

Any other all-to-all of a step (the tier-2 exchange inside a node, a replica sync) has none, wherever
it comes in the step. Only `all_to_all_single` calls take a role; analyses.context adds the column
as it loads `comms`.

    rank step seq tag                            role
    0    3    0   tier2_input_dist               null
    0    3    1   input_lengths                  input_lengths
    0    3    2   input_ids                      input_ids
    0    3    3   output_fwd_coded               output_fwd
  the same step recorded before the trainer labelled its calls:
    0    3    1   ShardedEmbeddings._input_dist  input_lengths
    0    3    2   ShardedEmbeddings._input_dist  input_ids
    0    3    3   _CodedAllToAll.forward         output_fwd
"""

from __future__ import annotations

from tracekit import tags

A2A = "all_to_all_single"

ROLE = {**{t: t for t in tags.EXCHANGE}, tags.OUTPUT_FWD_CODED: tags.OUTPUT_FWD, tags.OUTPUT_BWD_CODED: tags.OUTPUT_BWD}
"""The role of each label the reference trainer gives an exchange call."""


def _list(values) -> str:
    return ", ".join(f"'{v}'" for v in values)


def _cases(pairs: dict[str, str]) -> str:
    return " ".join(f"WHEN '{k}' THEN '{v}'" for k, v in pairs.items())


def with_roles(source: str) -> str:
    """SQL: the rows of `source` (a relation with comms' columns) with their `role` column."""
    exchange = f"op = '{A2A}' AND coalesce(tag, '') NOT LIKE '{tags.TORCHREC_SPLITS}%'"
    trainer = f"tag IN ({_list([*ROLE, tags.LEGACY_INPUT_DIST, *tags.LEGACY_OUTPUT])})"
    legacy = {old: ROLE[new] for old, new in tags.LEGACY_OUTPUT.items()}
    order = f"[{_list(tags.EXCHANGE)}]"
    return f"""
        SELECT * EXCLUDE (tk_x, tk_by_tag, tk_by_order, tk_calls, tk_trainer),
               CASE WHEN NOT tk_x THEN NULL
                    WHEN tag IN ({_list(ROLE)}) THEN CASE tag {_cases(ROLE)} END
                    WHEN tag = '{tags.LEGACY_INPUT_DIST}' AND tk_by_tag <= 2 THEN {order}[tk_by_tag]
                    WHEN tag IN ({_list(legacy)}) THEN CASE tag {_cases(legacy)} END
                    WHEN NOT tk_trainer AND tk_calls = {len(tags.EXCHANGE)} THEN {order}[tk_by_order]
               END AS role
        FROM (SELECT *, coalesce({exchange}, false) AS tk_x,
                     row_number() OVER (PARTITION BY rank, step, phase, tag ORDER BY seq) AS tk_by_tag,
                     row_number() OVER (PARTITION BY rank, step, phase, coalesce({exchange}, false) ORDER BY seq)
                         AS tk_by_order,
                     count(*) OVER (PARTITION BY rank, step, phase, coalesce({exchange}, false)) AS tk_calls,
                     coalesce(bool_or({exchange} AND {trainer}) OVER (PARTITION BY rank, step, phase), false)
                         AS tk_trainer
              FROM {source})"""


def label_sql() -> str:
    """SQL over comms' columns (with `role`): the tag a call carries, a tag of a run recorded before the
    trainer labelled its exchange read as the label it gives that call now, so the runs of both compare
    call by call."""
    return (f"CASE WHEN tag = '{tags.LEGACY_INPUT_DIST}' AND role IS NOT NULL THEN role "
            f"WHEN tag IN ({_list(tags.LEGACY_OUTPUT)}) THEN CASE tag {_cases(tags.LEGACY_OUTPUT)} END "
            f"ELSE tag END")
