"""Which collective of the embedding exchange each recorded call is: the `role` column of `comms`
(and `train_comms`), one of tracekit.tags.EXCHANGE (input_lengths, input_ids, output_fwd,
output_bwd), null for every other call. The one place an analysis learns a call's role from:

- a call the trainer labelled with its role (tracekit/dlrm/sharding.py): its tag;
- a run recorded before the trainer labelled them: the two calls tagged tracekit.tags.
  LEGACY_INPUT_DIST of a (rank, step, phase), in `seq` order, are the lengths then the ids; the
  calls tagged with a key of LEGACY_OUTPUT are the output dist's forward and backward;
- a (rank, step, phase) whose calls carry neither (a TorchRec run, whose calls cannot be
  labelled): its all-to-alls, TorchRec's all-to-all of split sizes (tags.TORCHREC_SPLITS) aside,
  when they are four, in `seq` order (the input dist's lengths and ids, the output dist's
  forward and backward of one sharding group); a step with more (several sharding groups) or
  fewer is left without roles.

Only `all_to_all_single` calls take a role. analyses.context adds the column as it loads `comms`.
"""

from __future__ import annotations

from tracekit import tags

A2A = "all_to_all_single"


def _list(values) -> str:
    return ", ".join(f"'{v}'" for v in values)


def with_roles(source: str) -> str:
    """SQL: the rows of `source` (a relation with comms' columns) with their `role` column."""
    exchange = f"op = '{A2A}' AND coalesce(tag, '') NOT LIKE '{tags.TORCHREC_SPLITS}%'"
    known = f"tag IN ({_list([*tags.EXCHANGE, tags.LEGACY_INPUT_DIST, *tags.LEGACY_OUTPUT])})"
    legacy_output = " ".join(f"WHEN '{tag}' THEN '{role}'" for tag, role in tags.LEGACY_OUTPUT.items())
    order = f"[{_list(tags.EXCHANGE)}]"
    return f"""
        SELECT * EXCLUDE (tk_x, tk_by_tag, tk_by_order, tk_calls, tk_known),
               CASE WHEN NOT tk_x THEN NULL
                    WHEN tag IN ({_list(tags.EXCHANGE)}) THEN tag
                    WHEN tag = '{tags.LEGACY_INPUT_DIST}' AND tk_by_tag <= 2 THEN {order}[tk_by_tag]
                    WHEN tag IN ({_list(tags.LEGACY_OUTPUT)}) THEN CASE tag {legacy_output} END
                    WHEN NOT tk_known AND tk_calls = {len(tags.EXCHANGE)} THEN {order}[tk_by_order]
               END AS role
        FROM (SELECT *, coalesce({exchange}, false) AS tk_x,
                     row_number() OVER (PARTITION BY rank, step, phase, tag ORDER BY seq) AS tk_by_tag,
                     row_number() OVER (PARTITION BY rank, step, phase, coalesce({exchange}, false) ORDER BY seq)
                         AS tk_by_order,
                     count(*) OVER (PARTITION BY rank, step, phase, coalesce({exchange}, false)) AS tk_calls,
                     coalesce(bool_or({exchange} AND {known}) OVER (PARTITION BY rank, step, phase), false) AS tk_known
              FROM {source})"""


INPUT_DIST = "input_dist"
PART = {tags.INPUT_LENGTHS: INPUT_DIST, tags.INPUT_IDS: INPUT_DIST, tags.OUTPUT_FWD: tags.OUTPUT_FWD,
        tags.OUTPUT_BWD: tags.OUTPUT_BWD}
"""The reference trainer's exchange as analyses.step_traffic splits it, by role: the input dist's two
calls as one part (one rank-to-rank matrix), each output call its own."""


def part_sql() -> str:
    """SQL over comms' columns: the exchange part (PART) of a call the reference trainer tagged, labelled
    or recorded before, else its tag ('' for none)."""
    trainer = f"tag IN ({_list([*tags.EXCHANGE, tags.LEGACY_INPUT_DIST, *tags.LEGACY_OUTPUT])})"
    cases = " ".join(f"WHEN '{role}' THEN '{part}'" for role, part in PART.items())
    return f"CASE WHEN {trainer} AND role IS NOT NULL THEN CASE role {cases} END ELSE coalesce(tag, '') END"


def part(tag: str, role: str | None) -> str:
    """part_sql for one call (a replay graph's)."""
    trainer = tag in (*tags.EXCHANGE, tags.LEGACY_INPUT_DIST, *tags.LEGACY_OUTPUT)
    return PART[role] if trainer and role is not None else tag
