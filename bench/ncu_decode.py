"""One paged decode attention call per pool dtype, for Nsight Compute: the production
kernel (default launch parameters) on FP8 pages and on bf16 pages at one shape, so an
``ncu`` run can compare their hardware counters (memory throughput, warp stall reasons).

    ncu --clock-control none --kernel-name regex:_decode_split_kernel --launch-count 2 \
        --set full -o $OUT/decode python3 bench/ncu_decode.py --shape 32x8192

Shape: Llama-3-8B attention (32 query heads, 8 kv heads, D 128), page 16, scattered pages
(``kv_speed_gpu.make_pools`` / ``page_table``). The FP8 call comes first, then bf16.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from kv_speed_gpu import HEAD_DIM, HEADS, make_pools, page_table  # noqa: E402

from radixlm.kernels.decode_attention import decode_attention  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="32x8192", help="batch x context")
    args = ap.parse_args()
    batch, ctx = (int(x) for x in args.shape.split("x"))
    device = torch.device("cuda")
    gen = torch.Generator(device="cpu").manual_seed(0)
    pools, num_pages = make_pools(batch * ctx + 1024, device, torch.Generator(device=device).manual_seed(0))
    table = page_table(batch, ctx, num_pages, device, gen)
    seq = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(device, torch.bfloat16)
    for name in ("fp8_e4m3", "base"):
        k, v, ks, vs, _ = pools[name]
        decode_attention(q, k, v, table, seq, HEAD_DIM**-0.5, k_scale=ks, v_scale=vs)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
