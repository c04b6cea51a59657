"""Imported by every Python process that `tracekit record` starts (this folder is on PYTHONPATH).

It does nothing until the process imports torch, and nothing at all in the torchrun launcher;
then `collectors.bootstrap.activate()` installs the collectors. See collectors/bootstrap.py.
"""

import os

if os.environ.get("TRACEKIT_RUN_DIR"):
    from collectors import bootstrap

    bootstrap.arm()
