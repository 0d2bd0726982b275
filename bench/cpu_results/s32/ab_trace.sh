#!/bin/bash
# The served-stage A/B of session 32 (ab_trace.txt), from the checkout root. Setup: for
# old (d0d888e) and new (9db0cbd), an importable copy of the package with
# bench/served_ttft_trace.diff applied, in $DIR/pkg_old and $DIR/pkg_new (mkold.sh of
# bench/cpu_results/s29 after `git archive COMMIT | tar -x` + `patch -p1`), and a tiny-shape
# checkpoint in $DIR/ckpt/tiny (gpu_e2e.build_checkpoint). new0 = new with --idle-spin-ms 0.
# Run with bench/served_ttft_trace.py's TTRACE_CLIENT=httpx, TTRACE_PAIRS=0, 80 requests 5 ms apart.
DIR=${DIR:-/tmp/s32}
for round in 1 2 3; do
  for side in old new0 new; do
    pkg=${side%0}; extra=""; [ "$side" = new0 ] && extra="--idle-spin-ms 0"
    out=$(PYTHONPATH=$DIR/pkg_$pkg TTRACE_GAP=0.005 TTRACE_N=80 TTRACE_CLIENT=httpx TTRACE_PAIRS=0 \
          timeout 600 .venv/bin/python bench/served_ttft_trace.py $DIR/ckpt/tiny $DIR/srv_$side.log \
          --device cpu --log-level warning $extra 2>/dev/null)
    echo "$out" | python3 -c "
import json,sys; d=json.load(sys.stdin)
for n in ('128','16'):
    s=d[n]; print('round $round side $side n', n, 'A_mw %.3f route %.3f body %.3f tm %.3f hop %.3f launch0 %.3f after_flush %.3f first %.3f' % (s['A_mw'], s['H_route'], s['H_route']-s['A_mw'], s['B_send']-s['H_route'], s['C_sched_recv']-s['B_send'], s['D_launch0'], s['Z_first']-s['E_flush'], s['Z_first']))
"
  done
done
