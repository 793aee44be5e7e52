#!/usr/bin/env python3
"""Per-thread CPU time of every `pipe` process, sampled, and where it went around a loss.

    python3 experiments/survival/cpu_sampler.py sample OUT.jsonl SECONDS &
    pipe train ... --placement processes --fault-schedule 3:exit@N
    python3 experiments/survival/cpu_sampler.py report OUT.jsonl PID_OF_LOST_WORKER

`sample` writes, every few milliseconds, each thread's time on a CPU (the first field of
/proc/PID/task/TID/schedstat, in ns) for every process whose program's name starts with
`pipe` (`pipe`, or a copy such as `target/compare/pipe-REV`). `report`
takes the loss as the first sample without the lost worker's process and prints, for windows
of 50 ms around it, the cores the `pipe` processes kept busy, each process's share of a core
and the busiest threads. Worker processes are named by their pid (`ps` during the run, or
the order of the launch: rank 0 is started first); the sampler's own time is not counted.
"""
import json
import os
import sys
import time


def sample(out_path, seconds):
    end = time.time() + seconds
    with open(out_path, "w") as out:
        while time.time() < end:
            now, rows = time.time(), []
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
                    if not os.path.basename(cmd[0]).startswith(b"pipe"):
                        continue
                    for tid in os.listdir(f"/proc/{pid}/task"):
                        ns = int(open(f"/proc/{pid}/task/{tid}/schedstat").read().split()[0])
                        rows.append((int(pid), int(tid), ns))
                except (OSError, IndexError, ValueError):
                    continue
            out.write(json.dumps([now, rows]) + "\n")
            time.sleep(0.002)


def report(path, lost_pid):
    samples = [json.loads(line) for line in open(path)]
    alive = [any(r[0] == lost_pid for r in rows) for _, rows in samples]
    seen = alive.index(True)
    loss = samples[seen + alive[seen:].index(False)][0]
    nearest = lambda t: min(range(len(samples)), key=lambda i: abs(samples[i][0] - t))
    for a, b in ((-0.1, -0.05), (-0.05, 0), (0, 0.05), (0.05, 0.1), (0.1, 0.15), (0.15, 0.2)):
        i, j = nearest(loss + a), nearest(loss + b)
        dt = samples[j][0] - samples[i][0]
        first = {(p, t): ns for p, t, ns in samples[i][1]}
        used = {(p, t): ns - first[(p, t)] for p, t, ns in samples[j][1] if (p, t) in first}
        per_pid = {}
        for (p, _), ns in used.items():
            per_pid[p] = per_pid.get(p, 0) + ns
        busy = sum(used.values()) / 1e9 / dt
        shares = " ".join(f"{p}:{ns / 1e7 / dt:.0f}%" for p, ns in sorted(per_pid.items()))
        print(f"[{a * 1e3:+.0f}, {b * 1e3:+.0f}] ms: {busy:.2f} cores busy; {shares}")
        hot = sorted(used.items(), key=lambda kv: -kv[1])[:5]
        print("    busiest threads: "
              + ", ".join(f"{p}/{t} {ns / 1e6:.1f} ms" for (p, t), ns in hot))


if __name__ == "__main__":
    if sys.argv[1] == "sample":
        sample(sys.argv[2], float(sys.argv[3]))
    else:
        report(sys.argv[2], int(sys.argv[3]))
