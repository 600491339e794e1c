# shellcheck shell=bash
# Sourced by train.sh and launch.sh. `quoted_job_args CONFIG WORKDIR [FLAG...]` prints the job's arguments, each word
# quoted (`printf %q`) for the workers' shell: --config CONFIG --workdir WORKDIR, then EXTRA's words (split on
# whitespace only, no quote removal), then the FLAGs as the local shell gave them.
quoted_job_args() {
  local extra=()
  [[ -z "${EXTRA:-}" ]] || read -r -d '' -a extra <<< "$EXTRA" || true
  local args=(--config "$1" --workdir "$2" "${extra[@]}" "${@:3}")
  printf '%q ' "${args[@]}"
}
