#!/usr/bin/env bash
# Stop the train job on every worker the way a preemption does: SIGTERM, a checkpoint at the end of the iteration.
#   TPU_NAME=flowrl ZONE=us-east5-a bash tpu_scripts/stop.sh        (then tpu_scripts/train.sh resumes)
# Signals only the process in ~/flowrl_train.pid (train.sh's python process), if it is alive and is a flowrl_jax.main
# process (a stale pidfile's PID may belong to another process by now). Nothing is matched by name: `pkill -f
# flowrl_jax.main` would also hit the ssh command running it. The job then finishes the iteration it is in, skips the
# eval, saves a checkpoint and exits 75 ("stopped by a signal: rerun the same command").
# Once only: a second SIGTERM while the first is pending kills the job at once WITHOUT saving (the train job's own
# rule), so each worker keeps ~/flowrl_train.stopping holding the PID it signalled, and a second stop.sh for that
# PID sends nothing, it only waits (train.sh removes the file when it starts a job). FORCE=1 is the one way to kill:
# SIGKILL at once, and the iterations since the last checkpoint are lost.
# Waits up to STOP_WAIT seconds (0 = do not wait) for the job to exit and reports per worker; a job still running
# after the wait fails the script (it goes on stopping: run stop.sh again to wait more). The default is 1800 s
# because stopping can take the rest of the iteration in flight, and on a v5p-8 at SD3.5-M's size a signal during
# start-up waits for loading + compiling (minutes) + that first iteration (minutes): 600 s was shorter than that.
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}" "${STOP_WAIT:=1800}" "${FORCE:=0}"
[[ "$STOP_WAIT" =~ ^[0-9]+$ ]] || { echo "stop.sh: STOP_WAIT must be a number of seconds, not '$STOP_WAIT'" >&2; exit 2; }
[[ "$FORCE" =~ ^[01]$ ]] || { echo "stop.sh: FORCE is 0 or 1, not '$FORCE'" >&2; exit 2; }

remote="stop_wait=$STOP_WAIT force=$FORCE
$(cat <<'REMOTE'
pidfile=~/flowrl_train.pid exitfile=~/flowrl_train.exit marker=~/flowrl_train.stopping
alive() { local s; s=$(ps -o stat= -p "$1" 2>/dev/null) && [[ $s != Z* ]]; }
status() { if [ -s "$exitfile" ]; then echo "exit status $(cat "$exitfile")"; else echo "exit status not recorded"; fi; }
if [ ! -s "$pidfile" ]; then echo "no train job here (no $pidfile)"; exit 0; fi
pid=$(cat "$pidfile")
if ! alive "$pid"; then echo "train job $pid is not running ($(status))"; exit 0; fi
if ! grep -aq flowrl_jax.main "/proc/$pid/cmdline" 2>/dev/null; then
  echo "pid $pid is not a flowrl_jax.main process (stale pidfile): nothing signalled"
  exit 0
fi
if [ "$force" = 1 ]; then
  kill -KILL "$pid"
  echo "FORCE=1: SIGKILL sent to train job $pid; the iterations since its last checkpoint are lost"
elif [ -s "$marker" ] && [ "$(cat "$marker")" = "$pid" ]; then
  echo "train job $pid was sent SIGTERM already (by an earlier stop.sh): not signalled again (a second SIGTERM kills without saving); waiting"
else
  echo "$pid" > "$marker"
  kill -TERM "$pid"
  echo "SIGTERM sent to train job $pid"
fi
[ "$stop_wait" -gt 0 ] || exit 0
deadline=$((SECONDS + stop_wait))
while alive "$pid"; do
  if [ "$SECONDS" -ge "$deadline" ]; then
    echo "train job $pid still running after ${stop_wait} s (still stopping: run stop.sh again to wait, FORCE=1 to kill)"
    exit 1
  fi
  sleep 1
done
sleep 0.5  # the wrapper notes the exit status right after the process ends
echo "train job $pid stopped ($(status))"
REMOTE
)"
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all --command="$remote"
