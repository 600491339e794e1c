#!/usr/bin/env bash
# Copy this checkout to every worker of the TPU VM and install it there with the TPU build of jax.
#   TPU_NAME=flowrl ZONE=us-central2-b bash tpu_scripts/setup.sh
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}"
cd "$(dirname "$0")/.."
gcloud compute tpus tpu-vm scp --recurse --zone="$ZONE" --worker=all \
  flowrl_jax configs requirements.txt pyproject.toml README.md "$TPU_NAME":~/flowrl_jax/
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all --command="
  cd ~/flowrl_jax && python3 -m pip install -q -r requirements.txt 'jax[tpu]>=0.8,<0.13' gcsfs google-cloud-storage && python3 -m pip install -q --no-deps -e . &&
  python3 -c 'import jax; print(jax.process_index(), jax.local_device_count(), jax.device_count())'"
