#!/usr/bin/env bash
# Trains the default experiment (experiments/gpt_tiny.py: data=2 x tensor=2 x pipe=2,
# interleaved 1F1B) on 8 forced CPU devices: 300 steps, about 2.5 minutes on a
# 2-core machine. Extra flags are passed on, e.g.
#   scripts/train.sh --config.train.steps=50 --workdir=runs/short
# The summary prints the venv's own tensorboard (installed with the package).
# The explicit empty argument: without one, the sourced script would see our "$@".
source "$(dirname "${BASH_SOURCE[0]}")/env.sh" ""
exec python -m triax train --config=experiments/gpt_tiny.py --workdir=runs/gpt_tiny \
    --cpu_devices=8 "$@"
