"""The commands: what `tracekit record / analyze / compare / report / optimize / cluster ...` run.

They wire the layers together: the contracts at the top of `tracekit/` (schema, store, policy,
manifest), the collectors that run inside a traced process, the analyses and the reports. Nothing
outside this package imports it but `python -m tracekit` (tracekit/__main__.py); heavy modules are
imported lazily, inside the command that needs them, so `tracekit --help` starts fast.
"""
