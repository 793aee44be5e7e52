#!/usr/bin/env python3
"""The CUDA cross-entropy's first pass (kernels.cu, `softmax_xent_f32`), emulated lane by lane
in numpy on the CPU: 32 lanes each keep their first maximum and their sum of f32 exponentials
in f64, rescaled in f64 when the maximum grows; the warp's butterfly then combines the lanes'
(maximum, arg-max, sum) triples. Checks that every lane ends with the same triple, that the
maximum and the first arg-max are the row's, and prints the sum's error relative to the f64
sum of exponentials, on rows of GPT-2's 50,257 classes and a few shorter ones (fewer columns
than lanes included). Run: `python3 experiments/gpu/xent_numerics.py` (numpy only).
"""
import math

import numpy as np


def lane_pass(row, lane):
    """One lane's pass over columns lane, lane + 32, ...: (maximum, its first index, sum)."""
    best, arg, s = -np.inf, 0, 0.0
    for j in range(lane, len(row), 32):
        v = np.float32(row[j])
        if v > best:
            s *= math.exp(float(best) - float(v))
            best, arg = v, j
        if best != -np.inf:
            s += float(np.exp(np.float32(v - best)))
    return best, arg, s


def warp(row):
    """The kernel's warp: the lanes' passes, then the butterfly over offsets 16 to 1."""
    lanes = [lane_pass(row, lane) for lane in range(32)]
    offset = 16
    while offset > 0:
        combined = []
        for lane in range(32):
            (b, a, s), (ob, oa, os) = lanes[lane], lanes[lane ^ offset]
            top = max(b, ob)
            mine = s if b == top else s * math.exp(float(b) - float(top))
            theirs = os if ob == top else os * math.exp(float(ob) - float(top))
            arg = oa if (ob > b or (ob == b and oa < a)) else a
            combined.append((top, arg, mine + theirs))
        lanes, offset = combined, offset // 2
    assert all(x == lanes[0] for x in lanes), "the lanes disagree"
    return lanes[0]


def main():
    rng = np.random.default_rng(0)
    for n, spread in [(50257, 8.0), (50257, 1.0), (1000, 8.0), (33, 8.0), (5, 8.0), (1, 8.0)]:
        row = (rng.uniform(-1, 1, n) * spread).astype(np.float32)
        if n == 50257:
            row[100] = row[40000] = np.float32(20.0)
        best, arg, s = warp(row)
        top = row.max()
        want = np.exp(row.astype(np.float64) - float(top)).sum()
        assert best == top and arg == int(np.argmax(row)), (n, best, arg)
        print(f"{n} classes, spread {spread}: maximum and arg-max the row's; "
              f"sum relative error {abs(s - want) / want:.1e}")


if __name__ == "__main__":
    main()
