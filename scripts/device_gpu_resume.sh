#!/usr/bin/env bash
# On a GPU machine (the device tool's nvidia-h200): an interruptible run's preemption and restore on a GPU, with
# broker installed into the machine's own Python (its torch, no new venv) from the carried wheels
# (scripts/prepare_device_tools.sh; run(carry=[".whl"])).  The pretend cloud (its "instances" are this machine)
# takes the first instance back BROKER_FAKE_PREEMPT seconds after it runs; broker notices it at its node check,
# rents again, restores the last copied checkpoint on the GPU and the job resumes (recipes/ddp_train.py
# --resume-dir, torch.load(map_location=cuda)).  Writes the transcript to $OUT/h200x1_gpu_resume.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LOG="$OUT/h200x1_gpu_resume.txt"
say() { echo "=== $(date -u +%FT%TZ) $*" | tee -a "$LOG"; }
PY=${PYTHON:-python3}
say "host: $("$PY" --version 2>&1), torch $("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda)')"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee -a "$LOG"
"$PY" -m pip install -q --no-index --find-links .whl broker >>"$LOG" 2>&1 || { say "pip install failed"; exit 1; }
# broker runs from /tmp: from the checkout root, "python -m broker" would import the source tree's broker/, which has
# no broker.providers (the installed wheel maps the top-level providers/ there)
export BROKER_HOME=/tmp/bh BROKER_FAKE_STATE=/tmp/bh/fake-cloud.json PYTHONDONTWRITEBYTECODE=1
rm -rf /tmp/bh /tmp/gpuspot && mkdir -p /tmp/bh /tmp/gpuspot
cp -r recipes/ddp_train.py recipes/data /tmp/gpuspot/

# how long an epoch takes here, so the preemption lands mid-job after a few checkpoint copies
t0=$(date +%s.%N)
(cd /tmp/gpuspot && "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 ddp_train.py --epochs 40 \
  --checkpoint /tmp/gpuspot/calib.pt >/tmp/gpuspot/calib.log 2>&1) || { say "calibration failed"; cat /tmp/gpuspot/calib.log >>"$LOG"; exit 1; }
t1=$(date +%s.%N)
EPOCHS=$("$PY" -c "import math; per=max(($t1-$t0-8)/40, 0.005); print(max(200, math.ceil(150/per)))")
rm -f /tmp/gpuspot/calib.pt
say "calibration: 40 epochs in $("$PY" -c "print(round($t1-$t0, 1))") s (start-up included) -> --epochs $EPOCHS for ~150 s"

cat > /tmp/gpuspot/gpu_spot.yaml <<EOF
name: gpu-spot
script: ddp_train.py
args: ["--epochs", "$EPOCHS", "--resume-dir", "checkpoints", "--save-every", "1", "--checkpoint", "final.pt"]
workdir: .
nodes: 1
gpus_per_node: 1
cpu_ok: false
topology: simulated
budget_usd: 5
max_hours: 0.5
interruptible: true
checkpoint_dir: checkpoints
checkpoint_every_s: 10
max_restarts: 2
expect: ["ALLREDUCE_OK", "DDP_OK"]
EOF
cd /tmp
say "\$ BROKER_FAKE_PREEMPT=45 broker run /tmp/gpuspot/gpu_spot.yaml --provider fake -y"
BROKER_FAKE_PREEMPT=45 "$PY" -m broker run /tmp/gpuspot/gpu_spot.yaml --provider fake -y 2>&1 \
  | grep -v -E '^\[node 0\] epoch=[0-9]*([1-9][0-9]|[0-9][1-9]) ' | tee -a "$LOG"  # every 100th epoch
say "exit status: ${PIPESTATUS[0]}"
say "\$ broker status latest"; "$PY" -m broker status latest 2>&1 | tee -a "$LOG"
say "\$ broker cost"; "$PY" -m broker cost 2>&1 | tee -a "$LOG"
run=$(ls -d /tmp/bh/runs/*/ | tail -1)
say "node logs of $run: every attempt's device and resume lines"
grep -h -E "device=|resumed_from_epoch|DDP_OK|heldout" "$run"/attempt*/node0.log "$run"/node0.log 2>/dev/null | tee -a "$LOG"
say "fake cloud instances"; "$PY" -c "import json; d=json.load(open('/tmp/bh/fake-cloud.json'));
[print(i['ordinal'], i['id'], i['state'], 'reclaimed' if i.get('reclaimed') else '') for i in d['instances'].values()]" | tee -a "$LOG"
