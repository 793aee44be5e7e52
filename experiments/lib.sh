# What the experiment scripts share: reading a run's output and summarising repeated rounds.
# Source it: `. experiments/lib.sh` (from the repository root).

# build_pipe: builds the release binary (its output on stderr) and sets `pipe` to its path.
build_pipe() {
  cargo build --release --locked --bin pipe >&2
  pipe=$PWD/target/release/pipe
}

# pipe_precision P: the `--precision` of a PRECISIONS entry: P, or P+cblas (P with the CPU's
# f32 products by the CBLAS library that CBLAS names, through PIPE_CBLAS: kernels/src/cblas.rs).
pipe_precision() {
  echo "${1%+cblas}"
}

# pipe_cblas P: the PIPE_CBLAS of a PRECISIONS entry: CBLAS for P+cblas, else empty (gemm).
# Called once outside a substitution, it stops the script when CBLAS is unset.
pipe_cblas() {
  case $1 in
    *+cblas) echo "${CBLAS:?CBLAS must name the CBLAS library of a +cblas column}" ;;
  esac
}

# scratch_dir: sets `out` to a fresh directory, removed when the script exits.
scratch_dir() {
  out=$(mktemp -d)
  trap 'rm -rf "$out"' EXIT
}

# epoch_rate FILE UNIT: the first epoch's rate in a run's output (UNIT: tokens/s or samples/s).
epoch_rate() {
  awk -v unit="$2" '/^epoch +1 /{for(i=1;i<=NF;i++) if($i==unit) print $(i-1)}' "$1"
}

# final_digest FILE: the last weights digest a run printed.
final_digest() {
  sed -n 's/.*weights \([0-9a-f]*\).*/\1/p' "$1" | tail -1
}

# medians FILE: for a file of "NAME RATE" lines, one "NAME MEDIAN" line per name, in the order
# the names first appear.
medians() {
  python3 - "$1" <<'PY'
import statistics, sys
rates = {}
for line in open(sys.argv[1]):
    name, rate = line.split()
    rates.setdefault(name, []).append(float(rate))
for name, values in rates.items():
    print(name, statistics.median(values))
PY
}

# median_table FILE BASE LABEL: the medians of FILE as Markdown rows "| NAME | MEDIAN |
# MEDIAN / BASE's |", with LABEL naming the first column and BASE the name divided by.
median_table() {
  echo
  echo "| $3 | median | against $2 |"
  echo "|---|---|---|"
  medians "$1" | awk -v base="$2" '{ name[NR] = $1; med[NR] = $2; if ($1 == base) b = $2 }
    END { for (i = 1; i <= NR; i++) printf "| %s | %.0f | %.3f |\n", name[i], med[i], med[i] / b }'
}
