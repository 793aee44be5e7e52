#!/usr/bin/env python3
"""Runs a `pipe train` command under a pseudo-terminal, as a user's terminal would, and reports
how its start went: when each phase line appeared, when the first update began and ended,
and the longest stretch before the first update ended in which nothing was drawn (no phase
line, no moving bar). Stops the run once its first update has ended (or at --limit).

    silence.py [--label TEXT] [--limit SECONDS] [--until REGEX] [--json FILE] -- pipe train ...

--until stops at the first line matching REGEX instead (a build that prints no phase lines: its
partition line). Prints one summary line; --json appends the figures as one JSON line to FILE.
"""
import argparse
import json
import os
import pty
import re
import select
import signal
import sys
import time

PHASE_BEGIN = re.compile(rb"^(?P<name>[a-z][a-z ,-]+?) (\(.*\) )?\.\.\.$")
ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default="")
    ap.add_argument("--limit", type=float, default=600.0)
    ap.add_argument("--json")
    ap.add_argument("--until")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    pid, fd = pty.fork()
    if pid == 0:
        os.execvp(cmd[0], cmd)
    t0 = time.monotonic()
    last = t0
    longest, longest_after = 0.0, ""
    lines, pending = [], b""
    begun = ended = until = None
    stop = re.compile(a.until) if a.until else None
    while time.monotonic() - t0 < a.limit:
        ready, _, _ = select.select([fd], [], [], 0.05)
        if not ready:
            continue
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        now = time.monotonic()
        if ended is None and now - last > longest:
            longest = now - last
            longest_after = lines[-1][1] if lines else "(the command's start)"
        last = now
        pending += chunk
        *whole, pending = re.split(rb"[\r\n]", pending)
        for raw in whole:
            text = ANSI.sub(b"", raw).strip()
            if not text:
                continue
            line = text.decode(errors="replace")
            lines.append((now - t0, line))
            if begun is None and line.startswith("the first update ("):
                begun = now - t0
            if ended is None and line.startswith("the first update:"):
                ended = now - t0
            if stop and until is None and stop.search(line):
                until = now - t0
        if ended is not None or until is not None:
            break
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.waitpid(pid, 0)
    shown = re.compile(r"^([a-z][a-z ,-]+: [0-9.]+ s|partition |memory estimate|warning: )")
    phases = [(t, l) for t, l in lines if PHASE_BEGIN.match(l.encode()) or shown.match(l)]
    for t, l in phases:
        print(f"  {t:7.2f} s  {l[:150]}")
    result = {
        "label": a.label,
        "until_s": until,
        "first_update_began_s": begun,
        "first_update_ended_s": ended,
        "longest_silence_s": round(longest, 3),
        "longest_silence_after": longest_after[:120],
    }
    fmt = lambda v: "never" if v is None else f"{v:.1f} s"
    if stop:
        print(f"{a.label}: '{a.until}' at {fmt(until)}")
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(result) + "\n")
        return 0 if until is not None else 1
    print(
        f"{a.label}: first update began at {fmt(begun)}, ended at {fmt(ended)}; "
        f"longest silence before it ended {longest:.2f} s (after: {longest_after[:80]})"
    )
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps(result) + "\n")
    return 0 if begun is not None else 1


if __name__ == "__main__":
    sys.exit(main())
