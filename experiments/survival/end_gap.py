import re, subprocess, sys, time
# Usage: python3 experiments/survival/end_gap.py PIPE N (from the repository root, a release build).
# Runs the QUIC kill drill N times; prints wall - start-up phases - training time (the end's cost).
pipe, n = sys.argv[1], int(sys.argv[2])
args = "train --stages 4 --replicas 2 --epochs 2 --momentum 0.6 --partition 0-2,3-4,5-6,7-9 --schedule pipedream --placement processes --transport quic --fault-schedule 3:exit@13984".split()
for i in range(n):
    t0 = time.monotonic()
    out = subprocess.run([pipe] + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True).stdout
    wall = time.monotonic() - t0
    start = sum(float(m) for m in re.findall(r"^[a-z][a-z ()0-9]*: ([0-9.]+) s$", out, re.M))
    trained = float(re.search(r"^done: .*, ([0-9.]+) s$", out, re.M).group(1))
    w = re.search(r"weights ([0-9a-f]+)", out).group(1)
    print(f"{i+1} wall={wall:.1f} start={start:.1f} trained={trained:.1f} rest={wall-start-trained:.1f} {w}", flush=True)
