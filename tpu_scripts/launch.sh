#!/usr/bin/env bash
# Run one job on every worker at once (multi-host: jax.distributed initializes itself on TPU pods).
#   TPU_NAME=flowrl ZONE=us-central2-b CONFIG=configs/inspect_mmdit.py:sd35_medium \
#   WORKDIR=gs://bucket/run1 EXTRA="--config.mesh=(('data',-1),('fsdp',8))" bash tpu_scripts/launch.sh
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}" "${CONFIG:?set CONFIG}" "${WORKDIR:=/tmp/flowrl_run}" "${EXTRA:=}"
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all --command="
  cd ~/flowrl_jax && python3 -m flowrl_jax.main --config $CONFIG --workdir $WORKDIR $EXTRA 2>&1 | tee -a ~/flowrl_run.log"
