# Source on the GPU host from the repo root: installs the carried wheels (.whl/: `pip download`
# of the dependencies the host lacks, for its Python) into /tmp/site and makes this checkout
# importable as `radixlm` without pip (the host's torch/triton/transformers stay as they are).
#   . bench/gpu_env.sh && python3 bench/e2e/gpu_e2e.py ...
# (a later call on the same warm machine may leave .whl/ out of its carry: /tmp/site stays)
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || return 1
elif [ ! -d /tmp/site ]; then
    echo "gpu_env.sh: no .whl/ carried and no /tmp/site installed" >&2; return 1
fi
mkdir -p /tmp/pkg/radixlm
cp radixlm_pkg/__init__.py /tmp/pkg/radixlm/
for d in runtime radix kernels frontend; do ln -sfn "$PWD/$d" "/tmp/pkg/radixlm/$d"; done
export PYTHONPATH="/tmp/pkg:/tmp/site:$PWD" PYTHONUNBUFFERED=1
