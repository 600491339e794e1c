#!/usr/bin/env bash
# Put the data a job reads (the diffusers pipeline folder, prompt datasets) on every worker's local disk.
#   TPU_NAME=flowrl ZONE=us-east5-a bash tpu_scripts/stage.sh gs://bucket/models/sd35m gs://bucket/prompts/pickscore
#   TPU_NAME=flowrl ZONE=us-east5-a bash tpu_scripts/stage.sh ./data/pickscore          (a local folder)
# Each SOURCE lands in ~/$STAGE_DIR/<its last path component> on every worker (STAGE_DIR default "data", relative to
# the home folder): gs://bucket/models/sd35m -> ~/data/sd35m. A gs:// source is copied by every worker itself, in
# parallel (`gcloud storage rsync --recursive` over ssh: the VM's service account needs read access; running it again
# copies only what changed); a local folder is sent from here with `gcloud compute tpus tpu-vm scp --recurse`.
# Jobs run in ~/flowrl_jax, so they name the staged copies ../data/<name> (or /home/<user>/data/<name>).
# Why local disk: safetensors are memory-mapped from local disk, every host reads its own copy at the same time
# (no bucket bottleneck), and the loader reads local paths only. gs:// stays for the workdir (checkpoints, metrics).
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}" "${STAGE_DIR:=data}"
if [[ $# -eq 0 ]]; then
  echo "usage: TPU_NAME=... ZONE=... bash tpu_scripts/stage.sh SOURCE... (gs://bucket/path or a local folder)" >&2
  exit 2
fi
if [[ "$STAGE_DIR" == /* || "$STAGE_DIR" == *..* ]]; then
  echo "stage.sh: STAGE_DIR is a folder under the workers' home folders (like data), not '$STAGE_DIR'" >&2
  exit 2
fi

ssh_all() { gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all --command="$1"; }
for src in "$@"; do
  name=$(basename "${src%/}")
  dst="$STAGE_DIR/$name"
  if [[ "$src" == gs://* ]]; then
    echo "stage.sh: $src -> ~/$dst on every worker (gcloud storage rsync)"
    ssh_all "mkdir -p ~/$(printf '%q' "$dst") && gcloud storage rsync --recursive $(printf '%q' "${src%/}") ~/$(printf '%q' "$dst")"
  elif [[ -d "$src" ]]; then
    echo "stage.sh: $src -> ~/$dst on every worker (scp)"
    ssh_all "mkdir -p ~/$(printf '%q' "$STAGE_DIR")"
    gcloud compute tpus tpu-vm scp --recurse --zone="$ZONE" --worker=all "${src%/}" "$TPU_NAME:~/$STAGE_DIR/"
  else
    echo "stage.sh: $src is neither gs://... nor a local folder" >&2
    exit 2
  fi
done
ssh_all "du -sh ~/$(printf '%q' "$STAGE_DIR")/*"
