# Sourced by the GPU scripts (run.sh, gpt2.sh): `step LIMIT COMMAND...` runs COMMAND under
# its own time limit, its output and exit status appended to "$log"; the header names the
# card, its driver and the date.
step() {
  local limit=$1
  shift
  echo "== $* (limit ${limit}s)" | tee -a "$log"
  local start=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee -a "$log"
  echo "-- exit ${PIPESTATUS[0]} after $((SECONDS - start)) s" | tee -a "$log"
}
log_header() {
  { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } 2>&1 | tee "$log"
}
