#!/usr/bin/env bash
# Start (or resume) the train job on every worker of a TPU VM / pod slice, in the background, workdir on a bucket.
#   TPU_NAME=flowrl ZONE=us-east5-a CONFIG=configs/sd35m_pickscore.py:v5p-8 WORKDIR=gs://bucket/runs/pickscore \
#   bash tpu_scripts/train.sh --config.world.pipeline=../data/sd35m --config.world.train_prompts=../data/pickscore
# Flags for the job: the arguments after the script's own (they keep the local shell's quoting, so
# --config.mesh="(('data',-1),('fsdp',8))" arrives as one argument), and/or EXTRA, which is split on whitespace only
# (quotes inside EXTRA are not removed: EXTRA="--config.mesh=(('data',-1),('fsdp',8))" works, a value with a space
# does not; pass that one as an argument). EXTRA's words come first. Every word travels to the workers quoted.
# Jobs run in ~/flowrl_jax with ~/flowrl_jax/.venv/bin/python (setup.sh): relative paths are relative to ~/flowrl_jax,
# so ../data/NAME is what stage.sh put in ~/data/NAME.
# Every worker runs the same command (jax.distributed finds its peers on a pod); only process 0 writes metrics,
# PNGs and checkpoint metadata, and prints the progress bar: follow it with
#   gcloud compute tpus tpu-vm ssh $TPU_NAME --zone=$ZONE --worker=0 --command="tail -f ~/flowrl_train.log"
# Per worker: ~/flowrl_train.pid holds the python process's PID, ~/flowrl_train.exit its exit status once it ended
# (0 done, 75 stopped by a signal after saving or a reward server unreachable: rerun, 2 a config error: fix first,
# others: may be retried); ~/flowrl_train.log gets the output (appended) and a line per start and exit. A worker
# whose job is still running refuses to start a second one. Starting removes stop.sh's ~/flowrl_train.stopping.
# Stop: SIGTERM (`tpu_scripts/stop.sh`, a maintenance event) makes every process save a checkpoint at the end of its
# iteration and exit 75; running this script again with the same WORKDIR resumes. A preempted (spot) slice is gone
# with its disks: tpu_scripts/recover.sh makes it again and resumes; supervise.sh does all of this unattended.
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}" "${CONFIG:?set CONFIG}" "${WORKDIR:?set WORKDIR (gs://bucket/...)}"
# shellcheck source=tpu_scripts/job_args.sh source-path=SCRIPTDIR
source "$(dirname "$0")/job_args.sh"
quoted=$(quoted_job_args "$CONFIG" "$WORKDIR" "$@")
echo "train.sh: python -m flowrl_jax.main $quoted"

remote="args=($quoted)
$(cat <<'REMOTE'
pidfile=~/flowrl_train.pid exitfile=~/flowrl_train.exit log=~/flowrl_train.log
alive() { local s; s=$(ps -o stat= -p "$1" 2>/dev/null) && [[ $s != Z* ]]; }
cd ~/flowrl_jax || exit 1
if [ -s "$pidfile" ] && pid=$(cat "$pidfile") && alive "$pid" && grep -aq flowrl_jax.main "/proc/$pid/cmdline" 2>/dev/null; then
  echo "a train job is already running here (pid $pid); stop it first (tpu_scripts/stop.sh)"
  exit 1
fi
rm -f "$pidfile" "$exitfile" ~/flowrl_train.stopping  # a new job: stop.sh may signal it (once)
echo "[train.sh $(date -u +%FT%TZ)] start: python -m flowrl_jax.main ${args[*]}" >> "$log"
# A wrapper waits for the job to note its exit status; the pidfile holds the python process itself (stop.sh signals it).
PYTHONUNBUFFERED=1 nohup bash -c '
  "$@" >> ~/flowrl_train.log 2>&1 < /dev/null &
  pid=$!
  echo "$pid" > ~/flowrl_train.pid
  wait "$pid"
  status=$?
  echo "$status" > ~/flowrl_train.exit
  echo "[train.sh $(date -u +%FT%TZ)] pid $pid exited with status $status" >> ~/flowrl_train.log
' flowrl_train ~/flowrl_jax/.venv/bin/python -m flowrl_jax.main "${args[@]}" > /dev/null 2>&1 < /dev/null &
for _ in $(seq 100); do [ -s "$pidfile" ] && break; sleep 0.1; done
if [ ! -s "$pidfile" ]; then echo "the job did not start (no $pidfile after 10 s); see $log"; exit 1; fi
sleep 1
if [ -s "$exitfile" ] && [ "$(cat "$exitfile")" != 0 ]; then
  echo "the job (pid $(cat "$pidfile")) exited at once with status $(cat "$exitfile"); the end of $log:"
  tail -n 20 "$log"
  exit 1
fi
echo "started pid $(cat "$pidfile"), log ~/flowrl_train.log"
REMOTE
)"
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all --command="$remote"
