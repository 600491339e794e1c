#!/usr/bin/env bash
# Create a Cloud TPU VM (single host or pod slice) with the runtime (software version) of its TPU family.
#   TPU_NAME=flowrl ZONE=us-central2-b ACCEL=v4-32 bash tpu_scripts/create.sh [--spot] [--network=NET] ...
# ACCEL is the accelerator type (v4-8, v5litepod-16, v5p-16, v6e-8, ...). RUNTIME overrides the runtime that the
# family's row below picks (Cloud TPU docs, "TPU software versions"):
#   v4-*          tpu-ubuntu2204-base
#   v5litepod-*   v2-alpha-tpuv5-lite     (v5e)
#   v5p-*         v2-alpha-tpuv5
#   v6e-*         v2-alpha-tpuv6e
# Extra flags for gcloud's create: CREATE_FLAGS (split on whitespace; recover.sh and supervise.sh pass it on, so a
# recreated slice gets the same ones), then the arguments after the script's own: --spot, --preemptible (tpu-vm
# only), --reserved, --network=..., --subnetwork=..., --service-account=..., --internal-ips, --tags=...
# QUEUED=1 asks through a queued resource (how v5p capacity is usually obtained): `gcloud compute tpus
# queued-resources create $TPU_NAME --node-id=$TPU_NAME ...` (the queued resource and its node share the name, so
# recover.sh can find both), then waits up to CREATE_WAIT seconds (default 3600; 0 = do not wait) for it to be
# ACTIVE, polling every CREATE_POLL seconds (default 30). A queued resource that ends FAILED or SUSPENDED, or is
# still waiting at the deadline, fails the script (the request stays queued in the last case: delete it with
# `gcloud compute tpus queued-resources delete $TPU_NAME --zone=$ZONE --force`, or wait longer).
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}" "${ACCEL:=v4-8}" "${QUEUED:=0}" "${CREATE_WAIT:=3600}" "${CREATE_POLL:=30}"
[[ "$CREATE_WAIT" =~ ^[0-9]+$ ]] || { echo "create.sh: CREATE_WAIT must be a number of seconds, not '$CREATE_WAIT'" >&2; exit 2; }

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
flags=()
[[ -z "${CREATE_FLAGS:-}" ]] || read -r -d '' -a flags <<< "$CREATE_FLAGS" || true
flags+=("$@")

if [[ "$QUEUED" != 1 ]]; then
  echo "create.sh: $TPU_NAME in $ZONE, $ACCEL, runtime $RUNTIME${flags[*]:+, flags ${flags[*]}}"
  gcloud compute tpus tpu-vm create "$TPU_NAME" --zone="$ZONE" --accelerator-type="$ACCEL" --version="$RUNTIME" \
    "${flags[@]}"
  exit 0
fi

echo "create.sh: queued resource $TPU_NAME (node $TPU_NAME) in $ZONE, $ACCEL, runtime $RUNTIME${flags[*]:+, flags ${flags[*]}}"
gcloud compute tpus queued-resources create "$TPU_NAME" --node-id="$TPU_NAME" --zone="$ZONE" \
  --accelerator-type="$ACCEL" --runtime-version="$RUNTIME" "${flags[@]}"
[ "$CREATE_WAIT" -gt 0 ] || exit 0
deadline=$((SECONDS + CREATE_WAIT)) last=""
while :; do
  # A failed describe (a network hiccup) is not the queued resource's state: poll again until the deadline.
  state=$(gcloud compute tpus queued-resources describe "$TPU_NAME" --zone="$ZONE" --format='value(state.state)') || state=""
  [[ "$state" == "$last" ]] || echo "create.sh: queued resource $TPU_NAME is ${state:-(describe failed)} after $SECONDS s"
  last=$state
  case "$state" in
    ACTIVE) break ;;
    FAILED | SUSPENDED)
      echo "create.sh: queued resource $TPU_NAME is $state; see gcloud compute tpus queued-resources describe $TPU_NAME --zone=$ZONE" >&2
      exit 1 ;;
  esac
  if [ "$SECONDS" -ge "$deadline" ]; then
    echo "create.sh: queued resource $TPU_NAME not ACTIVE after CREATE_WAIT=$CREATE_WAIT s (still $state; the request stays queued)" >&2
    exit 1
  fi
  sleep "$CREATE_POLL"
done
# ACTIVE means the node is provisioned; wait (within the same deadline) until the node itself reports READY.
while [[ "$(gcloud compute tpus tpu-vm describe "$TPU_NAME" --zone="$ZONE" --format='value(state)' 2>/dev/null)" != READY ]]; do
  if [ "$SECONDS" -ge "$deadline" ]; then echo "create.sh: node $TPU_NAME not READY after CREATE_WAIT=$CREATE_WAIT s" >&2; exit 1; fi
  sleep "$CREATE_POLL"
done
echo "create.sh: $TPU_NAME is READY ($SECONDS s)"
