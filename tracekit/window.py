"""Which steps a long job records: `record --steps A:B` (steps A to B−1) and `--every N:M` (the first
M of every N steps), together or alone. The collectors of accesses, lookups and comms skip every
other step at the cost of one check per call; the `steps` table keeps every step. Analyses take
only the recorded steps (analyses/context.py filters every table by `sql`), so per-step figures
average over them.

    window = Window.parse(steps="1000:5000", every="100:10")
    window.on(1005)          # True: in [1000, 5000) and 1005 % 100 < 10
    window.sql("step")       # "(step >= 1000 AND step < 5000 AND step % 100 < 10)"
    window.to_json()         # the manifest's collector_settings["window"]
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Window:
    first: int = 0
    stop: int | None = None  # None: to the end
    every: int = 1
    keep: int = 1

    @classmethod
    def parse(cls, *, steps: str | None = None, every: str | None = None) -> Window:
        """From `--steps A:B` and `--every N:M`; ValueError naming the option and the form expected."""
        first, stop = 0, None
        if steps is not None:
            a, sep, b = steps.partition(":")
            if not sep or not (a.strip() == "" or a.strip().isdigit()) or not (b.strip() == "" or b.strip().isdigit()):
                raise ValueError(f"--steps: expected FIRST:STOP such as 1000:2000 (either may be empty), got {steps!r}")
            first, stop = int(a or 0), int(b) if b.strip() else None
            if stop is not None and stop <= first:
                raise ValueError(f"--steps: STOP must be after FIRST, got {steps!r}")
        n, m = 1, 1
        if every is not None:
            a, sep, b = every.partition(":")
            if not (sep and a.strip().isdigit() and b.strip().isdigit() and 0 < int(b) <= int(a)):
                raise ValueError(f"--every: expected N:M with 0 < M <= N, e.g. 100:10 (10 steps of every 100), "
                                 f"got {every!r}")
            n, m = int(a), int(b)
        return cls(first, stop, n, m)

    @classmethod
    def of_settings(cls, settings: dict | None) -> Window:
        """The window a manifest's collector_settings name (every step where none)."""
        body = (settings or {}).get("window") or {}
        return cls(**body) if body else cls()

    @property
    def everything(self) -> bool:
        return self.first == 0 and self.stop is None and self.keep == self.every

    def on(self, step: int) -> bool:
        return (step >= self.first and (self.stop is None or step < self.stop)
                and (self.keep == self.every or step % self.every < self.keep))

    def sql(self, column: str = "step") -> str:
        """A SQL condition on `column` that holds on the recorded steps."""
        parts = [f"{column} >= {self.first}"] if self.first else []
        if self.stop is not None:
            parts.append(f"{column} < {self.stop}")
        if self.keep != self.every:
            parts.append(f"{column} % {self.every} < {self.keep}")
        return "(" + " AND ".join(parts) + ")" if parts else "TRUE"

    def describe(self) -> str:
        if self.everything:
            return "every step"
        every = "" if self.keep == self.every else f"the first {self.keep} of every {self.every} steps"
        if self.first == 0 and self.stop is None:
            return every
        span = f"steps {self.first} to {'the end' if self.stop is None else self.stop - 1}"
        return span + (f", {every}" if every else "")

    def to_json(self) -> dict | None:
        return None if self.everything else {"first": self.first, "stop": self.stop, "every": self.every,
                                              "keep": self.keep}
