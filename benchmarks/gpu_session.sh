#!/usr/bin/env bash
# The one prepared run for a lent CUDA machine (the device tool's `run`, from the repository root):
#   bash benchmarks/gpu_session.sh            (about 5-9 minutes on an H200; give it timeout_s=560)
# It needs only what that machine's image has (python3 with a CUDA torch, numpy, setuptools): zoomr is
# installed from this checkout without dependencies or network, then benchmarks/gpu_check.py runs: part 1
# checks the CUDA KV paths against dense attention and the CPU's selections, part 2 measures batched decode
# on a 7B-shaped random model at 16K (batch 1, 16, then 64: each row is saved as it finishes, so a run cut
# short still returns what it measured). Results land in $OUT (the device tool brings them back).
# Here, without a GPU: GPU_CHECK_ARGS="--device cpu --shape tiny --ctx 2400" BATCHES=1,2 runs the same steps.
set -uo pipefail
OUT=${OUT:-/tmp/zoomr_gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
else
    echo "no nvidia-smi on this machine (a CPU dry run)" | tee "$OUT/gpu.txt"
fi
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1 \
    || { tail -20 "$OUT/install.log"; exit 1; }
timeout "${GPU_CHECK_TIMEOUT:-500}" python3 benchmarks/gpu_check.py --batches "${BATCHES:-1,16,64}" \
    --json "$OUT/gpu_check.json" ${GPU_CHECK_ARGS:-} 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
