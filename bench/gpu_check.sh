#!/usr/bin/env bash
# The GPU checks of `tracekit record`, as one run on a lent GPU machine, from the repo root: the
# gpu-marked tests (NVML sampler, CUDA gradients, the trainer on CUDA, NCCL collectives, counting on a
# side stream, the Kaggle layout at batch 65,536 recorded with fed = recorded), then the tracing-overhead benchmark on
# CUDA: the 8-table workload, then the Criteo Kaggle layout at full size, batch 16384 (the target: recording costs <= 5%), 40 steps so that its last traced run (small enough to return) comes back as kaggle-run.tar.gz for `analyze` and
# `report` on the CPU machine (the NVML section drawn from real samples). That machine's python3 has torch, pyarrow, numpy, click, rich,
# nvidia-ml-py and pytest, but no polars or duckdb, so only these test files are collected.
# Logs go to $OUT (or /tmp/gpu-check).
set -u
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee -a "$out/gpu.txt"
timeout "${TESTS_TIMEOUT_S:-240}" python3 -m pytest -m gpu -v -p no:cacheprovider tests/test_gpu_collector.py tests/test_grads_collector.py \
    tests/test_record_cuda.py tests/test_device_counting.py 2>&1 | tee "$out/gpu-tests.log"
timeout "${BENCH_TIMEOUT_S:-200}" python3 bench/record_overhead.py --device cuda --python python3 --runs "${RUNS:-3}" \
    --quick 2>&1 | tee "$out/overhead-cuda.txt"
timeout "${KAGGLE_TIMEOUT_S:-240}" python3 bench/record_overhead.py --device cuda --python python3 --runs "${RUNS:-3}" \
    --quick --workload kaggle --steps "${KAGGLE_STEPS:-40}" --keep /tmp/kaggle-run 2>&1 | tee "$out/overhead-cuda-kaggle.txt"
tar -C /tmp -czf "$out/kaggle-run.tar.gz" kaggle-run 2>/dev/null || true
