. bench/gpu_env.sh || exit 1
T0=$(date +%s); L=$OUT/log.txt
lg() { echo "$* t=$(( $(date +%s)-T0 ))" >> $L; }
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader >> $L
timeout 540 python3 bench/offline_trace.py --tokenizer-dir .gpu_tok --dataset-path .gpu_data/sharegpt_subset.jsonl \
  --server-args "--max-running-requests 1024 --max-prefill-tokens 16384" --out /tmp/ot \
  --variant "default=" --variant "lof192=--schedule-policy lof --max-prefill-tokens 192" \
  --variant "lof256=--schedule-policy lof --max-prefill-tokens 256" --variant "default=" \
  --variant "lof384=--schedule-policy lof --max-prefill-tokens 384" --variant "lpm256=--max-prefill-tokens 256" \
  --variant "lof192=--schedule-policy lof --max-prefill-tokens 192" > $OUT/ot_log.txt 2>&1; lg "ot rc=$?"
grep "tok/s" $OUT/ot_log.txt >> $L
tar czf $OUT/ot.tgz -C /tmp ot
cat $L
