#!/usr/bin/env bash
# Regenerate requirements-tpu.lock: every package the TPU workers (tpu_scripts/setup.sh) and the GKE image
# (deploy/gke/Dockerfile) install, pinned with its whole closure, for Linux x86_64 and Python 3.11.
#   python3 -m venv /tmp/uvenv && /tmp/uvenv/bin/pip install uv      # uv, outside the repo's venv
#   UV=/tmp/uvenv/bin/uv bash deploy/gke/lock.sh
# jax[tpu], flax and orbax-checkpoint are pinned to this checkout's .venv (PYTHON) and everything else the venv has is a
# constraint (its `pip freeze`), so a slice runs the versions the tests ran; what the venv lacks (libtpu, gcsfs, the
# google-cloud libraries) takes the newest that fits. manylinux_2_31: libtpu's wheels need glibc 2.31 (the TPU VM
# images' Ubuntu 22.04 has 2.35, the image's Debian bookworm 2.36). No annotations: the constraint file is a temp file.
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${UV:=uv}" "${PYTHON:=.venv/bin/python}"
versions=$("$PYTHON" -c 'from importlib.metadata import version as v
print("jax[tpu]==" + v("jax"), "flax==" + v("flax"), "orbax-checkpoint==" + v("orbax-checkpoint"))')
read -r -a pins <<<"$versions"
freeze=$(mktemp)
trap 'rm -f "$freeze"' EXIT
# Local versions (torch 2.x+cpu) and editable installs are not on PyPI: left out of the constraints.
"$PYTHON" -m pip freeze --exclude-editable 2>/dev/null | grep -v -e '+' -e ' @ ' >"$freeze"
args=(requirements.txt - -c "$freeze" --python-version 3.11 --python-platform x86_64-manylinux_2_31 --no-annotate --no-header)
{
  echo "# requirements-tpu.lock: what the TPU workers and the GKE image install (uv pip install -r requirements-tpu.lock)."
  echo "# Regenerate with: UV=/tmp/uvenv/bin/uv bash deploy/gke/lock.sh   (it runs, with this venv's pip freeze as -c:)"
  printf '%s\n' "#   printf '%s\\n' ${pins[*]} gcsfs google-cloud-storage | uv pip compile ${args[*]/$freeze/<venv freeze>}"
  printf '%s\n' "${pins[@]}" gcsfs google-cloud-storage | "$UV" pip compile "${args[@]}" --quiet
} >requirements-tpu.lock.new
mv requirements-tpu.lock.new requirements-tpu.lock
echo "wrote requirements-tpu.lock ($(grep -c '==' requirements-tpu.lock) pins)"
