#!/usr/bin/env python3
"""Kills the replacement of a lost replica as soon as the run says it rejoined, cycle after
cycle, to show the window docs/reliability.md ("Not built") describes: a replacement lost
while the mesh it joins still connects.

The run is the small synthetic one of tests/workers.rs's twenty-cycle test (`--stages 2
--replicas 2 --rejoin`, worker processes). Worker 3 is killed with SIGKILL after the first
epoch; each time the line `the lost replicas rejoin:` appears, the new worker 3 is killed
after DELAY seconds. It prints the exit status, how many times the workers were started (1:
every loss was gone on without in place; more: a start fell back to the segment path) and how
many rejoins there were.

    python3 experiments/survival/join_race.py TRANSPORT CYCLES DELAY [OUT]

e.g. `python3 experiments/survival/join_race.py quic 20 0`. The run's output is written to
OUT (default join-race.txt), each line with the seconds since the start.
"""

import os
import subprocess
import sys
import tempfile
import time

PIPE = os.environ.get("PIPE", "target/release/pipe")
CONFIG = (
    'epochs = 1000\ndataset = "synthetic"\nmodel = "mlp-64-32x8-10"\nthreads = 1\n'
    "[synthetic]\ninputs = 64\nclasses = 10\nhidden = 32\ntrain = 65536\ntest = 256\n"
)


def kill_rank(launcher: int, rank: int) -> bool:
    listed = subprocess.run(
        ["pgrep", "-P", str(launcher), "-a"], capture_output=True, text=True
    ).stdout
    for line in listed.splitlines():
        pid, cmd = line.split(" ", 1)
        if f"--rank {rank} " in cmd + " ":
            os.kill(int(pid), 9)
            return True
    return False


def main() -> None:
    transport, cycles, delay = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    out = sys.argv[4] if len(sys.argv) > 4 else "join-race.txt"
    with tempfile.TemporaryDirectory() as d:
        config = os.path.join(d, "cycles.toml")
        with open(config, "w") as f:
            f.write(CONFIG)
        run = subprocess.Popen(
            [PIPE, "train", "--config", config, "--stages", "2", "--replicas", "2"]
            + ["--steps", "40000", "--transport", transport, "--rejoin"]
            + ["--momentum", "0.5", "--lr-schedule", "constant", "--partition", "0-8,9-17"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        t0 = time.monotonic()
        # Each line as read, with the seconds since the start.
        lines: list[tuple[float, str]] = []

        def until(prefix: str) -> bool:
            for line in run.stdout:
                lines.append((time.monotonic() - t0, line))
                if line.startswith(prefix):
                    return True
            return False

        until("epoch")
        for _ in range(cycles):
            kill_rank(run.pid, 3)
            lines.append((time.monotonic() - t0, "(killed worker 3)\n"))
            if not until("the lost replicas rejoin:"):
                break
            time.sleep(delay)
        until("\0")
        run.wait()
    text = "".join(line for _, line in lines)
    with open(out, "w") as f:
        f.writelines(f"{t:8.2f} {line}" for t, line in lines)
    print(
        f"exit {run.returncode}, starts {text.count('the first update (every')}, "
        f"rejoins {text.count('the lost replicas rejoin:')}"
    )


if __name__ == "__main__":
    main()
