#!/usr/bin/env bash
# Start (or resume) the train job on every worker of a TPU VM / pod slice, in the background, workdir on a bucket.
#   TPU_NAME=flowrl ZONE=us-east5-a CONFIG=configs/sd35m_geneval.py:v5p-8 WORKDIR=gs://bucket/runs/geneval \
#   EXTRA="--config.world.pipeline=/data/sd35m --config.world.train_prompts=data/geneval --config.world.test_prompts=data/geneval" \
#   bash tpu_scripts/train.sh
# Every worker runs the same command (jax.distributed finds its peers on a pod); only process 0 writes metrics,
# PNGs and checkpoint metadata, and prints the progress bar: follow it with
#   gcloud compute tpus tpu-vm ssh $TPU_NAME --zone=$ZONE --worker=0 --command="tail -f ~/flowrl_train.log"
# Preemption / stop: SIGTERM (what a maintenance event sends; `tpu_scripts/stop.sh`) makes every process save a
# checkpoint at the end of its iteration and exit. Resuming is running this script again with the same WORKDIR.
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}" "${CONFIG:?set CONFIG}" "${WORKDIR:?set WORKDIR (gs://bucket/...)}" "${EXTRA:=}"
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all --command="
  cd ~/flowrl_jax && nohup python3 -m flowrl_jax.main --config $CONFIG --workdir $WORKDIR $EXTRA >> ~/flowrl_train.log 2>&1 &
  sleep 1; echo \"worker \$(hostname): started, log ~/flowrl_train.log\""
