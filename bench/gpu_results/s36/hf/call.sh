. bench/gpu_env.sh || exit 1
T0=$(date +%s); L=$OUT/log.txt
lg() { echo "$* t=$(( $(date +%s)-T0 ))" >> $L; }
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader >> $L
ls /tmp/models/bfloat16/ >> $L 2>&1
timeout 560 python3 -c "import sys; from radixlm.runtime import bench_serving; bench_serving.main(sys.argv[1:])" \
  --backend hf-generate-batch --model-path /tmp/models/bfloat16/llama3-8b --device cuda \
  --dtype bfloat16 --dataset-name sharegpt --dataset-path .gpu_data/sharegpt_subset.jsonl \
  --num-prompts 1000 --tokenizer .gpu_tok --seed 1 --output-file $OUT/hf_1000.jsonl > $OUT/hf.log 2>&1; lg "hf rc=$?"
tail -30 $OUT/hf.log >> $L
cat $L
