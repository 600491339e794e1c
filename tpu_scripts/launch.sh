#!/usr/bin/env bash
# Run one job on every worker at once, in the foreground (multi-host: jax.distributed initializes itself on TPU pods).
#   TPU_NAME=flowrl ZONE=us-central2-b CONFIG=configs/inspect_mmdit.py:sd35_medium \
#   WORKDIR=gs://bucket/run1 bash tpu_scripts/launch.sh --config.mesh="(('data',-1),('fsdp',8))"
# Job flags as for train.sh: the arguments after the script's own, and/or EXTRA split on whitespace only (no quote
# removal), every word quoted on its way to the workers. Output goes to the terminal (worker-prefixed) and is appended
# to ~/flowrl_run.log on each worker; the script fails if the job fails on any worker.
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}" "${CONFIG:?set CONFIG}" "${WORKDIR:=/tmp/flowrl_run}"
# shellcheck source=tpu_scripts/job_args.sh source-path=SCRIPTDIR
source "$(dirname "$0")/job_args.sh"
quoted=$(quoted_job_args "$CONFIG" "$WORKDIR" "$@")
echo "launch.sh: python -m flowrl_jax.main $quoted"
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all --command="set -o pipefail
cd ~/flowrl_jax && PYTHONUNBUFFERED=1 ~/flowrl_jax/.venv/bin/python -m flowrl_jax.main $quoted 2>&1 | tee -a ~/flowrl_run.log"
