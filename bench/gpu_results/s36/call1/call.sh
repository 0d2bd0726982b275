. bench/gpu_env.sh || exit 1
T0=$(date +%s); L=$OUT/log.txt
lg() { echo "$* t=$(( $(date +%s)-T0 ))" >> $L; }
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader >> $L
python3 -c "import triton, inspect; from triton.compiler.compiler import CompiledKernel as C; print(triton.__version__); print(inspect.getsource(C.__getitem__))" >> $L 2>&1
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_launch.py tests/kernels/test_piecewise_forward.py "tests/kernels/test_triton_backend.py" > $OUT/pytest.txt 2>&1; lg "tests rc=$?"; tail -4 $OUT/pytest.txt >> $L
timeout 400 python3 bench/offline_trace.py --tokenizer-dir .gpu_tok --dataset-path .gpu_data/sharegpt_subset.jsonl \
  --server-args "--max-running-requests 1024 --max-prefill-tokens 16384" --out /tmp/ot \
  --variant "default=" --variant "lof256=--schedule-policy lof --max-prefill-tokens 256" \
  --variant "lof384=--schedule-policy lof --max-prefill-tokens 384" --variant "lof512=--schedule-policy lof --max-prefill-tokens 512" \
  --variant "default=" > $OUT/ot_log.txt 2>&1; lg "ot rc=$?"
grep "tok/s\|captured\|Error\|error" $OUT/ot_log.txt | head -20 >> $L
tar czf $OUT/ot.tgz -C /tmp ot
cat $L
