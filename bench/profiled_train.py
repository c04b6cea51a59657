"""The reference trainer under torch.profiler (CPU activities, shapes recorded), for
bench/record_overhead.py: the usual way to see what a DLRM run does, and what it costs.

    torchrun --standalone --nproc-per-node 2 bench/profiled_train.py --steps 200 --json
"""

import sys
from pathlib import Path

import torch.profiler

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tracekit.dlrm.train import main  # noqa: E402

if __name__ == "__main__":
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, record_shapes=True):
        code = main()
    sys.exit(code)
