# What the survival drills share (sourced after OUT is set): the pipe binary, the output
# folder, and the run's flags. The momentum is given: its default follows the layout, and a
# run keeps its own when it loses a replica.
PIPE=${PIPE:-target/release/pipe}
mkdir -p "$OUT"
F=(--stages 4 --epochs 1 --partition 0-2,3-4,5-6,7-9 --checkpoint-every 100 --keep-checkpoints 20
   --momentum 0.6)
