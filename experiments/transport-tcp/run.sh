#!/usr/bin/env bash
# pipe bench transport with every registered transport (inproc, shm, quic, tcp): the link
# costs the planner charges, streaming per transport beside a raw TCP socket, and the ring
# all-reduce in threads and across processes. Writes results.txt and results.json here.
# Usage: experiments/transport-tcp/run.sh [PIPE]   (default: target/release/pipe, built first)
set -euo pipefail
cd "$(dirname "$0")/../.."
pipe=${1:-}
if [ -z "$pipe" ]; then
  cargo build --release --locked
  pipe=target/release/pipe
fi
out=experiments/transport-tcp
# A scratch cache, so the link costs are measured in this run, not read from an older one.
cache=$(mktemp -d)
trap 'rm -rf "$cache"' EXIT
{
  echo "# $(date -u +%FT%TZ) $(git rev-parse --short HEAD) $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores"
  PIPE_CACHE_DIR=$cache "$pipe" bench transport --json "$out/results.json"
} | tee "$out/results.txt"
