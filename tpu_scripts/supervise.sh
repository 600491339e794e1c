#!/usr/bin/env bash
# Keep a run going without a person: watch the slice and the train job, recover or relaunch, stop when it is done.
#   TPU_NAME=flowrl ZONE=us-east5-a ACCEL=v5p-8 CREATE_FLAGS=--spot STAGE_SOURCES="gs://b/models/sd35m gs://b/prompts/pickscore" \
#   CONFIG=configs/sd35m_pickscore.py:v5p-8 WORKDIR=gs://bucket/runs/pickscore \
#   nohup bash tpu_scripts/supervise.sh --config.world.pipeline=../data/sd35m ... > supervise.log 2>&1 &
# Runs on the machine that launched the run (in the foreground or under nohup), with the variables and job flags of
# recover.sh (which it runs; they are train.sh's and create.sh's too). Every POLL seconds (default 60) it reads the
# slice's state (`tpu-vm describe --format='value(state)'`) and, on a READY slice, each worker's job (one ssh to all):
#   running     ~/flowrl_train.pid's process is alive (and a flowrl_jax.main process)
#   exited:N    it ended with status N (~/flowrl_train.exit); stopped:N when stop.sh had signalled it
#   lost        a pidfile but no process and no status (killed with its wrapper, e.g. a VM restart)
#   idle        set up (~/flowrl_jax/.venv) but no job started;  bare: not set up (a new or wiped VM)
# and decides (decide() below, one function; `supervise.sh --decide SLICE_STATE [JOB_STATE...]` prints its answer):
#   recover   the slice is missing (NOT_FOUND), PREEMPTED or TERMINATED, or a worker is bare -> recover.sh
#   relaunch  READY, no job running, and one exited 75 (stopped by a signal, or a reward server down), another
#             retryable status (not 0, not 2), lost or idle -> train.sh (resumes from the newest checkpoint)
#   done      every worker exited 0 -> exit 0
#   config_error  a worker exited 2 (a config/usage error: no restart fixes it) -> stop.sh for any still running,
#             the logs' tails, exit 2
#   stopped   a person's stop.sh stopped the job (its ~/flowrl_train.stopping) -> not relaunched, exit 3
#   running / wait  look again; a slice that stays neither READY nor gone (CREATING, REPAIRING, describe failing) or
#             whose workers do not answer ssh for UNHEALTHY_POLLS polls in a row (default 5) -> recover
# Bounded: after MAX_RECOVERIES recoveries and relaunches together (default 20) it exits 1. Every decision is logged
# with a UTC timestamp ("[supervise.sh 2026-...Z] ..."); a poll whose states did not change logs nothing.
set -euo pipefail

decide() {  # decide SLICE_STATE [JOB_STATE...] -> recover|relaunch|done|config_error|stopped|running|wait
  local slice=$1 s n=0 running=0 finished=0 config=0 stopped=0 bare=0
  shift
  case "$slice" in
    MISSING | PREEMPTED | TERMINATED) echo recover; return ;;
    READY) ;;
    *) echo wait; return ;;  # CREATING, STARTING, RESTARTING, REPAIRING, STOPPING, UNKNOWN (describe failed), ...
  esac
  [ $# -gt 0 ] || { echo wait; return; }  # READY but the workers did not answer
  for s in "$@"; do
    n=$((n + 1))
    case "$s" in
      running) running=$((running + 1)) ;;
      bare) bare=$((bare + 1)) ;;
      exited:0) finished=$((finished + 1)) ;;
      exited:2 | stopped:2) config=$((config + 1)) ;;
      stopped:[0-9]*) stopped=$((stopped + 1)) ;;
      exited:[0-9]* | lost | idle) ;;  # 75 (resumable), 1, 137 (killed), a crash, nothing started: relaunch
      *) echo wait; return ;;  # an answer not understood: look again
    esac
  done
  if [ "$bare" -gt 0 ]; then echo recover
  elif [ "$config" -gt 0 ]; then echo config_error
  elif [ "$running" -gt 0 ]; then echo running
  elif [ "$finished" -eq "$n" ]; then echo "done"
  elif [ "$stopped" -gt 0 ]; then echo stopped
  else echo relaunch
  fi
}

if [[ "${1:-}" == --decide ]]; then
  shift
  decide "$@"
  exit 0
fi

: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}" "${CONFIG:?set CONFIG}" "${WORKDIR:?set WORKDIR (gs://bucket/...)}"
: "${POLL:=60}" "${MAX_RECOVERIES:=20}" "${UNHEALTHY_POLLS:=5}"
[[ "$POLL" =~ ^[0-9]+(\.[0-9]+)?$ ]] || { echo "supervise.sh: POLL must be a number of seconds, not '$POLL'" >&2; exit 2; }
here=$(dirname "$0")

log() { echo "[supervise.sh $(date -u +%FT%TZ)] $*"; }

slice_state() {  # the TPU's state; MISSING when gcloud says NOT_FOUND, UNKNOWN when describe failed otherwise
  local out err
  err=$(mktemp)
  if out=$(gcloud compute tpus tpu-vm describe "$TPU_NAME" --zone="$ZONE" --format='value(state)' 2> "$err"); then
    echo "${out:-UNKNOWN}"
  elif grep -q NOT_FOUND "$err"; then
    echo MISSING
  else
    echo UNKNOWN
  fi
  rm -f "$err"
}

probe=$(cat <<'REMOTE'
pidfile=~/flowrl_train.pid exitfile=~/flowrl_train.exit marker=~/flowrl_train.stopping
alive() { local s; s=$(ps -o stat= -p "$1" 2>/dev/null) && [[ $s != Z* ]]; }
job() {
  if [ -s "$pidfile" ] && pid=$(cat "$pidfile") && alive "$pid" && grep -aq flowrl_jax.main "/proc/$pid/cmdline" 2>/dev/null; then
    echo running
  elif [ -s "$exitfile" ]; then
    code=$(cat "$exitfile")
    if [ "$code" != 0 ] && [ -s "$marker" ]; then echo "stopped:$code"; else echo "exited:$code"; fi
  elif [ -s "$pidfile" ]; then echo lost
  elif [ -x ~/flowrl_jax/.venv/bin/python ]; then echo idle
  else echo bare
  fi
}
s=$(job)
if [ "$s" = lost ]; then sleep 2; s=$(job); fi  # the wrapper notes the status just after the process ends
echo "flowrl-job-state $s"
REMOTE
)

job_states() {  # one state per worker on one line; nothing (and failure) when ssh failed
  local out
  out=$(gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all --command="$probe" 2>&1) || return 1
  grep -o 'flowrl-job-state [^[:space:]]*' <<< "$out" | awk '{ printf "%s ", $2 }'
}

actions=0 unhealthy=0 last=""
log "supervising $TPU_NAME in $ZONE (POLL=$POLL s, MAX_RECOVERIES=$MAX_RECOVERIES, UNHEALTHY_POLLS=$UNHEALTHY_POLLS)"
while :; do
  slice=$(slice_state)
  jobs=()
  if [[ "$slice" == READY ]] && answer=$(job_states); then read -r -a jobs <<< "$answer" || true; fi
  action=$(decide "$slice" "${jobs[@]}")
  seen="slice $slice, jobs ${jobs[*]:-(none read)}: $action"
  [[ "$seen" == "$last" ]] || log "$seen"
  last=$seen
  case "$action" in
    running) unhealthy=0 ;;
    wait)
      unhealthy=$((unhealthy + 1))
      if [ "$unhealthy" -ge "$UNHEALTHY_POLLS" ]; then
        log "the slice was not READY with answering workers for $unhealthy polls in a row: recover"
        action=recover
      fi ;;
    done) log "every worker's job exited 0: the run is complete"; exit 0 ;;
    stopped)
      log "stop.sh stopped the job (~/flowrl_train.stopping): not relaunching; run supervise.sh again to go on"
      exit 3 ;;
    config_error)
      log "a worker's job exited 2 (a config or usage error: a restart cannot fix it)"
      if [[ " ${jobs[*]} " == *" running "* ]]; then bash "$here/stop.sh" || true; fi
      gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all --command='tail -n 20 ~/flowrl_train.log' || true
      exit 2 ;;
  esac
  if [[ "$action" == recover || "$action" == relaunch ]]; then
    actions=$((actions + 1))
    if [ "$actions" -gt "$MAX_RECOVERIES" ]; then
      log "giving up: $MAX_RECOVERIES recoveries and relaunches (MAX_RECOVERIES) did not finish the run"
      exit 1
    fi
    unhealthy=0 last=""
    if [[ "$action" == recover ]]; then
      log "recover $actions of $MAX_RECOVERIES: recover.sh"
      if bash "$here/recover.sh" "$@"; then log "recover.sh done"; else log "recover.sh failed (status $?)"; fi
    else
      log "relaunch $actions of $MAX_RECOVERIES: train.sh (resumes from the newest checkpoint)"
      if bash "$here/train.sh" "$@"; then log "train.sh started the job"; else log "train.sh failed (status $?)"; fi
    fi
  fi
  sleep "$POLL"
done
