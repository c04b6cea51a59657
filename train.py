"""Entry point of the reference DLRM trainer; see tracekit/dlrm/train.py and `--help`."""

import sys

from tracekit.dlrm.train import main

if __name__ == "__main__":
    sys.exit(main())
