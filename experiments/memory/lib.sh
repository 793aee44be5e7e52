# Shared by the memory experiments: runs `pipe` with the given arguments in the background and
# records each `pipe worker` process's peak resident memory (VmHWM, read from /proc every
# 0.1 s; it only grows, so the last reading is its peak up to the last 0.1 s).
#
#   run_and_poll OUT_FILE PEAKS_FILE LABEL pipe-args...
# appends "LABEL RANK KB" to PEAKS_FILE for every worker, and writes the run's output to OUT_FILE.
run_and_poll() {
  local out=$1 peaks=$2 label=$3
  shift 3
  "$pipe" "$@" > "$out" 2>&1 &
  local launcher=$!
  declare -A peak=()
  while kill -0 "$launcher" 2>/dev/null; do
    for pid in $(pgrep -P "$launcher" -f "pipe worker" || true); do
      # A worker may exit between the listing and the reads: nothing is read then.
      rank=$(cat "/proc/$pid/cmdline" 2>/dev/null | tr '\0' ' ' | sed -n 's/.*--rank \([0-9]*\).*/\1/p' || true)
      kb=$(awk '/^VmHWM:/{print $2}' "/proc/$pid/status" 2>/dev/null || true)
      [ -n "$rank" ] && [ -n "$kb" ] && peak[$rank]=$kb
    done
    sleep 0.1
  done
  wait "$launcher"
  for w in "${!peak[@]}"; do echo "$label $w ${peak[$w]}" >> "$peaks"; done
}
