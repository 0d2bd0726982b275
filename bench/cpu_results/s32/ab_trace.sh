#!/bin/bash
cd /tmp/s32
for round in 1 2 3; do
  for side in old new0 new; do
    pkg=${side%0}; extra=""; [ "$side" = new0 ] && extra="--idle-spin-ms 0"
    out=$(PYTHONPATH=/tmp/s32/pkg_$pkg TTRACE_GAP=${GAP:-0.005} TTRACE_N=${N:-80} TTRACE_CLIENT=${CLIENT:-httpx} timeout 600 /work/main/.venv/bin/python /tmp/s32/trace.py /tmp/s32/ckpt/tiny /tmp/s32/srv_$side.log --device cpu --log-level warning $extra 2>/dev/null)
    echo "$out" | python3 -c "
import json,sys; d=json.load(sys.stdin)
for n in ('128','16'):
    s=d[n]; print('round $round side $side n', n, 'A_mw %.3f route %.3f body %.3f tm %.3f hop %.3f launch0 %.3f after_flush %.3f first %.3f' % (s['A_mw'], s['H_route'], s['H_route']-s['A_mw'], s['B_send']-s['H_route'], s['C_sched_recv']-s['B_send'], s['D_launch0'], s['Z_first']-s['E_flush'], s['Z_first']))
"
  done
done
