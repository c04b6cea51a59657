"""`python -m tracekit` runs the command line."""

from tracekit.cli import main

main()
