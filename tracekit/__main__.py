"""`python -m tracekit` runs the command line."""

from tracekit.app.cli import main

main()
