#!/usr/bin/env bash
# Bring back a slice that was preempted or lost and resume its run: delete, create, stage, setup, train.
#   TPU_NAME=flowrl ZONE=us-east5-a ACCEL=v5p-8 CREATE_FLAGS=--spot \
#   STAGE_SOURCES="gs://bucket/models/sd35m gs://bucket/prompts/pickscore" \
#   CONFIG=configs/sd35m_pickscore.py:v5p-8 WORKDIR=gs://bucket/runs/pickscore \
#   bash tpu_scripts/recover.sh --config.world.pipeline=../data/sd35m --config.world.train_prompts=../data/pickscore
# Why not train.sh again: a preempted spot/preemptible TPU cannot be restarted, and its VMs' disks (venv, code,
# staged data) are gone; create then fails with ALREADY_EXISTS until the old one is deleted. The run itself lives in
# WORKDIR (a bucket) and resumes from its newest checkpoint.
# The steps, each with the variables of the script it runs (pass the ones the slice was made with):
#   delete  the queued resource named TPU_NAME if there is one (`queued-resources delete --force`: its node too),
#           then the TPU in whatever state it is (`tpu-vm delete`); nothing when neither exists
#   create  create.sh: ACCEL, RUNTIME, CREATE_FLAGS, QUEUED, CREATE_WAIT
#   stage   stage.sh $STAGE_SOURCES (split on whitespace; STAGE_DIR); skipped when STAGE_SOURCES is empty
#   setup   setup.sh (JAX_PACKAGE, WITH_OCR)
#   train   train.sh with CONFIG, WORKDIR, EXTRA and this script's arguments: the same command resumes the run
# RECOVER_STEPS (default all five, in this order) redoes only some, e.g. RECOVER_STEPS="setup train" after a setup
# that failed. stage and setup are tried up to 3 times, RETRY_PAUSE seconds apart (default 30): ssh to VMs just
# created can fail until their keys have propagated. Each step prints "recover.sh: <step> <seconds> s"; a step that
# still fails ends the script (status 1) naming it.
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}" "${CONFIG:?set CONFIG}" "${WORKDIR:?set WORKDIR (gs://bucket/...)}"
: "${STAGE_SOURCES:=}" "${RECOVER_STEPS:=delete create stage setup train}" "${RETRY_PAUSE:=30}"
here=$(dirname "$0")
for s in $RECOVER_STEPS; do
  case "$s" in delete | create | stage | setup | train) ;; *)
    echo "recover.sh: unknown step '$s' in RECOVER_STEPS (delete create stage setup train)" >&2; exit 2 ;;
  esac
done

now() { echo "${EPOCHREALTIME:-$(date +%s)}"; }  # bash 5's clock has microseconds; older shells whole seconds
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

delete_slice() {
  local err state  # (a function run by `if` has set -e off: each failure returns by hand)
  err=$(mktemp)
  if gcloud compute tpus queued-resources describe "$TPU_NAME" --zone="$ZONE" --format='value(state.state)' > "$err" 2>&1; then
    echo "recover.sh: queued resource $TPU_NAME is $(cat "$err"): deleting it and its node"
    gcloud compute tpus queued-resources delete "$TPU_NAME" --zone="$ZONE" --force --quiet || return 1
  fi
  if state=$(gcloud compute tpus tpu-vm describe "$TPU_NAME" --zone="$ZONE" --format='value(state)' 2> "$err"); then
    echo "recover.sh: TPU $TPU_NAME is $state: deleting it"
    gcloud compute tpus tpu-vm delete "$TPU_NAME" --zone="$ZONE" --quiet || return 1
  elif grep -q NOT_FOUND "$err"; then
    echo "recover.sh: no TPU $TPU_NAME to delete"
  else  # describe failed for another reason (auth, network): creating now would only fail with ALREADY_EXISTS
    cat "$err" >&2
    rm -f "$err"
    return 1
  fi
  rm -f "$err"
}

stage_sources() {
  local sources=()
  read -r -d '' -a sources <<< "$STAGE_SOURCES" || true
  bash "$here/stage.sh" "${sources[@]}"
}

step() {  # step NAME TRIES COMMAND...: run it (again after RETRY_PAUSE, up to TRIES times), print its time
  local name=$1 tries=$2 t0 try=1 status
  shift 2
  t0=$(now)
  while :; do
    echo "recover.sh: $name (try $try of $tries)"
    if "$@"; then break; else status=$?; fi
    if [ "$try" -ge "$tries" ]; then
      echo "recover.sh: $name FAILED after $(since "$t0") s (status $status); fix it, then RECOVER_STEPS=\"<the rest>\"" >&2
      exit 1
    fi
    try=$((try + 1))
    sleep "$RETRY_PAUSE"
  done
  echo "recover.sh: $name $(since "$t0") s"
}

t_all=$(now)
for s in $RECOVER_STEPS; do
  case "$s" in
    delete) step delete 1 delete_slice ;;
    create) step create 1 bash "$here/create.sh" ;;
    stage)
      if [[ -z "${STAGE_SOURCES// /}" ]]; then echo "recover.sh: stage skipped (STAGE_SOURCES is empty)"; continue; fi
      step stage 3 stage_sources ;;
    setup) step setup 3 bash "$here/setup.sh" ;;
    train) step train 1 bash "$here/train.sh" "$@" ;;
  esac
done
echo "recover.sh: done in $(since "$t_all") s ($RECOVER_STEPS)"
