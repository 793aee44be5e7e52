#!/usr/bin/env python3
"""Kills timed at random, each run's end against the reference with the layout change.

The run of `tests/workers.rs` `a_killed_replica_leaves_its_stage_running_on_the_other`
(a small synthetic MLP, `--stages 2 --replicas 2 --steps 600 --checkpoint-every 50`, as
worker processes), many times: once the checkpoint at update 50 is written, worker 3 (stage
1's second replica) is killed with SIGKILL after a random wait of up to 4 ms, which lands the
loss anywhere from the segment after the checkpoint to the drain at the epoch's end (update
64) and the segment after it. Each run's layout change line names the update the new layout
starts at (`from update N`); its end weights must equal the undisturbed run's checkpoint at N
resumed by hand on replicas [2, 1], which the script computes once per N.

    python3 experiments/survival/random_kills.py RUNS [shm|quic] [OUTDIR] [WAIT_MS]

WAIT_MS (default 4) is the longest random wait; a QUIC run is slower, and reaches the drain
at update 64 only with a longer one (about 40 ms).

Prints, per outcome (`N` and the line's words after it), how many runs ended that way, with
`WRONG` where the weights differed and `RESTARTED` where the launcher started every worker
again; keeps each such run's output and log in OUTDIR (default /tmp/pipe-random-kills).
"""
import os
import random
import re
import shutil
import subprocess
import sys
import time

PIPE = os.environ.get("PIPE", "target/release/pipe")
RUNS = int(sys.argv[1])
TRANSPORT = sys.argv[2] if len(sys.argv) > 2 else "shm"
OUT = sys.argv[3] if len(sys.argv) > 3 else "/tmp/pipe-random-kills"
WAIT_S = (float(sys.argv[4]) if len(sys.argv) > 4 else 4.0) / 1000
BASE = ["--stages", "2", "--checkpoint-every", "50", "--keep-checkpoints", "100",
        "--momentum", "0.5", "--lr-schedule", "constant", "--partition", "0-8,9-17"]

os.makedirs(OUT, exist_ok=True)
CONFIG = os.path.join(OUT, "small.toml")
with open(CONFIG, "w") as f:
    f.write('epochs = 10000\ndataset = "synthetic"\nmodel = "mlp-64-32x8-10"\nthreads = 1\n'
            'partition = "flops"\n\n[synthetic]\ninputs = 64\nclasses = 10\nhidden = 32\n'
            'train = 2048\ntest = 256\n')
ENV = dict(os.environ, PIPE_CACHE_DIR=os.path.join(OUT, "cache"))
references = {}


def train(ck, *flags):
    shutil.rmtree(ck, ignore_errors=True)
    return [PIPE, "train", "--config", CONFIG, "--checkpoint-dir", ck, *BASE, *flags]


def reference(start):
    """The undisturbed run's checkpoint at `start` resumed on replicas [2, 1]: its weights."""
    if start not in references:
        calm = os.path.join(OUT, f"calm-{start}")
        subprocess.run(train(calm, "--replicas", "2", "--steps", str(start)), env=ENV,
                       capture_output=True, check=True)
        resumed = subprocess.run(
            train(os.path.join(OUT, f"resumed-{start}"), "--replicas", "2,1", "--steps", "600",
                  "--resume", os.path.join(calm, f"ckpt-{start:08}")),
            env=ENV, capture_output=True, check=True).stdout.decode()
        references[start] = re.search(r"weights (\w+)", resumed).group(1)
    return references[start]


def rank_of(parent, rank):
    """The pid of `parent`'s child running `--rank RANK`."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and f"--rank {rank} " in cmd:
            return int(entry)
    return None


outcomes = {}
for i in range(RUNS):
    ck = os.path.join(OUT, "ck")
    log = os.path.join(OUT, "run.jsonl")
    cmd = train(ck, "--steps", "600", "--replicas", "2", "--transport", TRANSPORT,
                "--log-jsonl", log)
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV)
    first = os.path.join(ck, "ckpt-00000050")
    while not os.path.exists(first) and launcher.poll() is None:
        time.sleep(0.0005)
    time.sleep(random.random() * WAIT_S)
    pid = rank_of(launcher.pid, 3)
    if pid:
        os.kill(pid, 9)
    text = launcher.communicate()[0].decode()
    line = re.search(r"from update (\d+) \(([a-z]+ [a-z]+)", text)
    done = re.search(r"done: .*weights (\w+)", text)
    if not line or not done:
        outcome = "no layout change" if done else "failed"
    else:
        outcome = f"{line.group(1)} {line.group(2)}"
        if done.group(1) != reference(int(line.group(1))):
            outcome += " WRONG"
        if text.count("the first update (every") > 1:
            outcome += " RESTARTED"
    if " " in outcome and outcome.split()[-1] in ("WRONG", "RESTARTED") or outcome == "failed":
        shutil.copy(log, os.path.join(OUT, f"kept-{i}.jsonl"))
        with open(os.path.join(OUT, f"kept-{i}.txt"), "w") as f:
            f.write(text)
    outcomes[outcome] = outcomes.get(outcome, 0) + 1
for outcome, count in sorted(outcomes.items()):
    print(f"{count:5}  {outcome}")
