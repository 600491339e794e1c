#!/usr/bin/env bash
# Create a Cloud TPU VM (single host or pod slice).
#   TPU_NAME=flowrl ZONE=us-central2-b ACCEL=v4-32 bash tpu_scripts/create.sh
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}" "${ACCEL:=v4-8}" "${RUNTIME:=tpu-ubuntu2204-base}"
gcloud compute tpus tpu-vm create "$TPU_NAME" --zone="$ZONE" --accelerator-type="$ACCEL" --version="$RUNTIME"
