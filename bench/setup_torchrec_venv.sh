#!/usr/bin/env bash
# Build the TorchRec peer-baseline venv at bench/.venv-torchrec (gitignored).
#
# Kept apart from the toolkit's .venv so TorchRec and its pins never leak into it.
# Recipe and the reasons for each pin: shared/research/env.md section 4.
#   - torch must be exactly 2.13.0: pip then takes the local +cpu wheel from /opt/wheels;
#     a range admits a multi-GB CUDA build.
#   - fbgemm-gpu-cpu 1.8.0 is the release built against torch 2.13 (1.N <-> torch 2.(N+5));
#     1.9.0 fails to load its .so with an undefined torch symbol.
#   - torchrec requires `fbgemm-gpu` (the CUDA distribution), which fbgemm-gpu-cpu does not
#     satisfy, so torchrec goes in with --no-deps and its other requirements are listed by hand.
#     `pip check` then reports "torchrec 1.8.0 requires fbgemm-gpu": expected and harmless.
#
# Idempotent: does nothing if the venv already imports torchrec on torch 2.13.0+cpu.
# Usage (from anywhere):  bash bench/setup_torchrec_venv.sh
set -euo pipefail

cd "$(dirname "$0")/.."          # repo root
VENV=bench/.venv-torchrec
PY=$VENV/bin/python
PIP="$VENV/bin/pip install --disable-pip-version-check"

if [ -x "$PY" ] && "$PY" -c '
import torch, torchrec, fbgemm_gpu
assert torch.__version__ == "2.13.0+cpu", torch.__version__
' 2>/dev/null; then
    echo "$VENV already imports torchrec on torch 2.13.0+cpu; nothing to do." >&2
    exit 0
fi

python3 -m venv "$VENV"
$PIP torch==2.13.0 numpy==2.4.6
$PIP fbgemm-gpu-cpu==1.8.0
$PIP --no-deps torchrec==1.8.0
# torch==2.13.0 is repeated here so tensordict's torch requirement cannot swap the build.
$PIP tensordict torchmetrics==1.0.3 tqdm pyre-extensions iopath torch==2.13.0

"$PY" - <<'EOF'
import torch, torchrec, fbgemm_gpu
assert torch.__version__ == "2.13.0+cpu", f"expected torch 2.13.0+cpu, got {torch.__version__}"
print(f"ok: torch {torch.__version__}, torchrec {torchrec.__version__}, fbgemm_gpu {fbgemm_gpu.__version__}")
EOF
