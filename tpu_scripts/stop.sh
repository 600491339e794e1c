#!/usr/bin/env bash
# Stop the train job on every worker the way a preemption does: SIGTERM, a checkpoint at the end of the iteration.
#   TPU_NAME=flowrl ZONE=us-east5-a bash tpu_scripts/stop.sh        (then tpu_scripts/train.sh resumes)
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}"
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all --command="pkill -TERM -f flowrl_jax.main || true"
