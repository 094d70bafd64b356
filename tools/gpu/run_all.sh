#!/usr/bin/env bash
# One device call: install the carried wheels, record the machine, then run each GPU runner of tools/gpu/ with
# its time budget, under a hard limit a little above it, so one failure or overrun does not lose the others.
#   bash tools/gpu/run_all.sh head:240 losses:180      # runner:seconds, in order; logs land in $OUT
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; export OUT
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled
# `python` and `fastlm` as commands (the image has only python3, and the package is not installed there).
mkdir -p /tmp/bin
rm -f /tmp/bin/python  # a wrapper, not a link: a venv's python finds its packages from its own path
printf '#!/bin/sh\nexec python3 "$@"\n' > /tmp/bin/python
printf '#!/bin/sh\nexec python3 -m fastlm "$@"\n' > /tmp/bin/fastlm
chmod +x /tmp/bin/fastlm /tmp/bin/python
export PATH=/tmp/bin:$PATH
{
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
    python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} > "$OUT/env.log" 2>&1
for part in "$@"; do
    name=${part%%:*}; limit=${part##*:}
    start=$(date +%s)
    timeout -k 15 $(( limit + 15 )) bash "tools/gpu/$name.sh" "$limit"
    echo "$name: exit $? after $(( $(date +%s) - start )) s (budget $limit)" | tee -a "$OUT/env.log"
done
