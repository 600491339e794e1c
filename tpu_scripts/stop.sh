#!/usr/bin/env bash
# Stop the train job on every worker the way a preemption does: SIGTERM, a checkpoint at the end of the iteration.
#   TPU_NAME=flowrl ZONE=us-east5-a bash tpu_scripts/stop.sh        (then tpu_scripts/train.sh resumes)
# Signals only the process in ~/flowrl_train.pid (train.sh's python process), if it is alive and is a flowrl_jax.main
# process (a stale pidfile's PID may belong to another process by now). Then waits up to STOP_WAIT seconds
# (default 600; 0 = do not wait) for it to exit, and reports per worker; a job still running after the wait fails
# the script. Nothing is matched by name: `pkill -f flowrl_jax.main` would also hit the ssh command running it.
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}" "${STOP_WAIT:=600}"
[[ "$STOP_WAIT" =~ ^[0-9]+$ ]] || { echo "stop.sh: STOP_WAIT must be a number of seconds, not '$STOP_WAIT'" >&2; exit 2; }

remote="stop_wait=$STOP_WAIT
$(cat <<'REMOTE'
pidfile=~/flowrl_train.pid exitfile=~/flowrl_train.exit
alive() { local s; s=$(ps -o stat= -p "$1" 2>/dev/null) && [[ $s != Z* ]]; }
status() { if [ -s "$exitfile" ]; then echo "exit status $(cat "$exitfile")"; else echo "exit status not recorded"; fi; }
if [ ! -s "$pidfile" ]; then echo "no train job here (no $pidfile)"; exit 0; fi
pid=$(cat "$pidfile")
if ! alive "$pid"; then echo "train job $pid is not running ($(status))"; exit 0; fi
if ! grep -aq flowrl_jax.main "/proc/$pid/cmdline" 2>/dev/null; then
  echo "pid $pid is not a flowrl_jax.main process (stale pidfile): nothing signalled"
  exit 0
fi
kill -TERM "$pid"
echo "SIGTERM sent to train job $pid"
[ "$stop_wait" -gt 0 ] || exit 0
deadline=$((SECONDS + stop_wait))
while alive "$pid"; do
  if [ "$SECONDS" -ge "$deadline" ]; then echo "train job $pid still running after ${stop_wait} s"; exit 1; fi
  sleep 1
done
sleep 0.5  # the wrapper notes the exit status right after the process ends
echo "train job $pid stopped ($(status))"
REMOTE
)"
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all --command="$remote"
