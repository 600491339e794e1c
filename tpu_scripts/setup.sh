#!/usr/bin/env bash
# Copy this checkout to every worker of the TPU VM and install it there in a uv venv (~/flowrl_jax/.venv, Python 3.11).
#   TPU_NAME=flowrl ZONE=us-central2-b bash tpu_scripts/setup.sh
# By default the packages come from requirements-tpu.lock (every package pinned, jax[tpu] and libtpu included;
# deploy/gke/lock.sh makes it), so a slice recreated mid-run gets the versions the run started with. JAX_PACKAGE set
# installs requirements.txt's ranges plus that jax requirement instead (the simulated pod passes "jax>=0.8,<0.13" and
# pins its own versions). The TPU images' python3 is 3.10 and flowrl_jax needs >= 3.11: uv (installed per worker with
# `python3 -m pip install --user uv`) makes the venv and brings a 3.11 interpreter when the image has none. Running it
# again updates the code and the packages; the venv is kept. WITH_OCR=1 also installs the OCR reward's engine
# (requirements-ocr.txt, not in the lock), for the `ocr` reward or a reward server serving it on the workers, and
# libgl1 with apt when the image lacks libGL.so.1 (opencv-python links it).
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}" "${JAX_PACKAGE:=}" "${WITH_OCR:=0}"
cd "$(dirname "$0")/.."

# scp copies into ~/flowrl_jax/ only once that folder exists on the worker.
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all --command="mkdir -p ~/flowrl_jax"
gcloud compute tpus tpu-vm scp --recurse --zone="$ZONE" --worker=all \
  flowrl_jax configs requirements.txt requirements-tpu.lock requirements-ocr.txt pyproject.toml README.md "$TPU_NAME":~/flowrl_jax/

remote="JAX_PACKAGE=$(printf '%q' "$JAX_PACKAGE") WITH_OCR=$(printf '%q' "$WITH_OCR")
$(cat <<'REMOTE'
set -euo pipefail
cd ~/flowrl_jax
if ! python3 -m uv --version >/dev/null 2>&1; then
  # Ubuntu 22.04's pip takes --user as is; an externally managed Python (PEP 668) also needs --break-system-packages.
  python3 -m pip install --user -q uv 2>/dev/null || python3 -m pip install --user -q --break-system-packages uv ||
    { echo "could not install uv with python3 -m pip (no pip? sudo apt-get install -y python3-pip)" >&2; exit 1; }
fi
[ -x .venv/bin/python ] || python3 -m uv venv --python 3.11 .venv
if [ -n "$JAX_PACKAGE" ]; then
  python3 -m uv pip install --python .venv/bin/python -r requirements.txt "$JAX_PACKAGE" gcsfs google-cloud-storage
else
  python3 -m uv pip install --python .venv/bin/python -r requirements-tpu.lock
fi
if [ "$WITH_OCR" = 1 ]; then
  # opencv-python needs libGL.so.1, which the TPU images may lack. (grep reads all of ldconfig's output: with
  # pipefail, `ldconfig -p | grep -q` can fail when grep exits first.)
  if ! grep -q 'libGL\.so\.1' < <(ldconfig -p 2>/dev/null); then
    sudo apt-get update -qq && sudo apt-get install -y -qq libgl1
  fi
  python3 -m uv pip install --python .venv/bin/python -r requirements-ocr.txt
fi
python3 -m uv pip install --python .venv/bin/python --no-deps -e .
.venv/bin/python -c 'import sys, jax, flowrl_jax; print("python", sys.version.split()[0], "jax", jax.__version__, jax.default_backend(), jax.local_device_count(), "local devices")'
REMOTE
)"
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all --command="$remote"
