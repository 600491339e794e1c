#!/usr/bin/env bash
# Create a Cloud TPU VM (single host or pod slice) with the runtime (software version) of its TPU family.
#   TPU_NAME=flowrl ZONE=us-central2-b ACCEL=v4-32 bash tpu_scripts/create.sh
# ACCEL is the accelerator type (v4-8, v5litepod-16, v5p-16, v6e-8, ...). RUNTIME overrides the runtime that the
# family's row below picks (Cloud TPU docs, "TPU software versions"):
#   v4-*          tpu-ubuntu2204-base
#   v5litepod-*   v2-alpha-tpuv5-lite     (v5e)
#   v5p-*         v2-alpha-tpuv5
#   v6e-*         v2-alpha-tpuv6e
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}" "${ACCEL:=v4-8}"

runtime_for() {  # the runtime of an accelerator type's family; fails for a family not in the table
  case "$1" in
    v4-*) echo tpu-ubuntu2204-base ;;
    v5litepod-*) echo v2-alpha-tpuv5-lite ;;
    v5p-*) echo v2-alpha-tpuv5 ;;
    v6e-*) echo v2-alpha-tpuv6e ;;
    *) return 1 ;;
  esac
}

if [[ -z "${RUNTIME:-}" ]]; then
  if ! RUNTIME=$(runtime_for "$ACCEL"); then
    echo "create.sh: no runtime known for ACCEL=$ACCEL (known families: v4-*, v5litepod-* (v5e), v5p-*, v6e-*);" \
      "set RUNTIME to the software version Cloud TPU lists for it" >&2
    exit 2
  fi
fi
echo "create.sh: $TPU_NAME in $ZONE, $ACCEL, runtime $RUNTIME"
gcloud compute tpus tpu-vm create "$TPU_NAME" --zone="$ZONE" --accelerator-type="$ACCEL" --version="$RUNTIME"
