"""The loss curve of a `pipe train --log-jsonl` log as a markdown table.

    python3 curve.py LOG.jsonl [--every N]

One row per N updates: the mean training loss of those updates, their median tokens/s and the
elapsed time at the last of them; then one row per epoch with its validation loss. Reads the
log's `step` and `epoch` records only; a log of epoch records alone gives the second table.
"""

import argparse
import json
import statistics


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("log")
    parser.add_argument("--every", type=int, default=400)
    args = parser.parse_args()
    steps, epochs = [], []
    with open(args.log) as f:
        for line in f:
            record = json.loads(line)
            if record["kind"] == "step":
                steps.append(record)
            elif record["kind"] == "epoch":
                epochs.append(record)

    if steps:
        print(f"Training loss, mean over each {args.every} updates (nats/token):")
        print()
        print("| updates | train loss | tokens/s (median) | elapsed |")
        print("|---|---|---|---|")
        for start in range(0, len(steps), args.every):
            window = steps[start:start + args.every]
            loss = statistics.fmean(r["loss"] for r in window)
            speed = statistics.median(r["tokens_per_sec"] for r in window)
            print(f"| {window[0]['step']}-{window[-1]['step']} | {loss:.4f} | {speed:.0f} | "
                  f"{window[-1]['elapsed_s']:.0f} s |")
        print()
    print("Validation after each epoch (the held-out last 10% of the tokens):")
    print()
    print("| epoch | updates | train loss | val loss (nats/token) | val accuracy | tokens/s | elapsed |")
    print("|---|---|---|---|---|---|---|")
    for r in epochs:
        # An epoch record's `steps` counts the run's updates so far.
        print(f"| {r['epoch']} | {r['steps']} | {r['train_loss']:.4f} | {r['test_loss']:.4f} | "
              f"{100 * r['test_accuracy']:.2f}% | {r['tokens_per_sec']:.0f} | {r['elapsed_s']:.0f} s |")
    best = min(epochs, key=lambda r: r["test_loss"])
    print()
    print(f"Lowest validation loss: {best['test_loss']:.4f} nats/token after epoch {best['epoch']}; "
          f"last: {epochs[-1]['test_loss']:.4f}. Overall training throughput: "
          f"{statistics.median(r['tokens_per_sec'] for r in epochs):.0f} tokens/s (median of the epochs).")


if __name__ == "__main__":
    main()
