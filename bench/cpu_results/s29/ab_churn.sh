#!/bin/bash
# usage: ab_churn.sh OLD_DIR ROUNDS (from the checkout's root; OLD_DIR made by mkold.sh)
# Alternates the old package and the working tree on the CPU proxy of the scheduler's host
# time per decode step (profile_step.py --stub-model --churn 256 at batch 64) and prints
# each side's busy ms per decode step, sorted. PROFILE (default bench/profile_step.py) picks
# the driver: a tree before Scheduler.serve_once needs the step-only driver of 069a5a2
# (git show 069a5a2:bench/profile_step.py > bench/profile_step_s28.py), used for both
# sides in churn_ab_stepcounter.txt.
PROFILE=${PROFILE:-bench/profile_step.py}
for i in $(seq "$2"); do
  for t in old new; do
    if [ $t = old ]; then pp=$1; else pp=; fi
    r=$(PYTHONPATH=$pp GPU_E2E_DEVICE=cpu .venv/bin/python "$PROFILE" --shape tiny --vocab 512 \
        --stub-model --tokenizer-dir .gpu_tok --batch 64 --churn 256 --no-profile --out /tmp/prof 2>&1 \
        | grep -o "busy [0-9.]*" | cut -d' ' -f2)
    echo "$t $r"
  done
done | sort | awk '{a[$1]=a[$1]" "$2} END {for (k in a) print k, a[k]}'
