#!/usr/bin/env bash
# PipeDream's claim on rate-limited links: for each link rate and model, the planner's pick,
# a straight pipeline and data parallelism run as worker processes on two "hosts" (network
# namespaces joined by a veth pair shaped with tbf), each against the simulator's prediction.
#
#   sudo experiments/hosts/run.sh [OUT_DIR]      # default experiments/hosts/results/DATE
#
# Needs root (ip netns, tc) and a release build (cargo build --release). Ranks fill
# the hosts in pipeline order (shared memory inside one, QUIC between). The namespaces are removed on exit.
set -euo pipefail
cd "$(dirname "$0")/../.."
pipe=${PIPE:-$PWD/target/release/pipe}
out=${1:-experiments/hosts/results/$(date -u +%F)}
updates=${UPDATES:-40}
mkdir -p "$out"
ns=(pipe-host-a pipe-host-b)
ips=(10.78.0.1 10.78.0.2)
devs=(pipe-va pipe-vb)

cleanup() {
  for n in "${ns[@]}"; do ip netns del "$n" 2>/dev/null || true; done
}
trap cleanup EXIT

# Two namespaces joined by a veth pair, each end shaped to RATE by a token bucket.
hosts_at() {
  local rate=$1 burst=$2
  cleanup
  ip netns add "${ns[0]}"
  ip netns add "${ns[1]}"
  ip link add "${devs[0]}" type veth peer name "${devs[1]}"
  for i in 0 1; do
    ip link set "${devs[$i]}" netns "${ns[$i]}"
    ip -n "${ns[$i]}" addr add "${ips[$i]}/24" dev "${devs[$i]}"
    ip -n "${ns[$i]}" link set "${devs[$i]}" up
    ip -n "${ns[$i]}" link set lo up
    ip netns exec "${ns[$i]}" tc qdisc add dev "${devs[$i]}" root tbf \
      rate "$rate" burst "$burst" latency 100ms
  done
}

{
  echo "# pipe bench hosts on rate-limited links"
  echo
  echo "Command: \`sudo experiments/hosts/run.sh\` ($(date -u '+%F %H:%M UTC'), $(nproc) cores of"
  echo "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . 2>/dev/null || echo ' with uncommitted changes'))."
  echo "Two network namespaces joined by a veth pair, each end shaped with"
  echo "\`tc qdisc ... tbf rate R\`; ranks fill them in pipeline order, two per namespace (shared memory inside one, QUIC between); $updates timed minibatches per run."
  echo
} > "$out/REPORT.md"

# rate for tc, burst, the same rate in bytes for the planner
for link in "10gbit 8mb 1250MB/s" "1gbit 1mb 125MB/s"; do
  read -r rate burst bytes <<< "$link"
  hosts_at "$rate" "$burst"
  for model in "mlp-784-1024x16-10 32" "gpt-mini 8"; do
    read -r name mb <<< "$model"
    echo "== $name at $rate" >&2
    {
      echo "## $name, $rate"
      echo
      echo "\`pipe bench hosts --model $name --microbatch-size $mb --bandwidth $bytes --hosts ${ips[0]},${ips[1]} --netns ${ns[0]},${ns[1]} --updates $updates\`"
      echo
      "$pipe" bench hosts --model "$name" --microbatch-size "$mb" --bandwidth "$bytes" \
        --hosts "${ips[0]},${ips[1]}" --netns "${ns[0]},${ns[1]}" --updates "$updates" \
        --json "$out/$name-$rate.json"
      echo
    } >> "$out/REPORT.md"
  done
done
cat "$out/REPORT.md"
