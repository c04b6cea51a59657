"""Policy derivations: one module per policy family, each a function from an opened run to a
PolicyResult (a policy.json section with its `predicted` figures and `why`, or the reason it cannot
be derived from this run). See DESIGN.md §5 and research/papers.md for the methods."""
