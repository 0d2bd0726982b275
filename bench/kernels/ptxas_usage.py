"""Registers, spills and shared memory of the paged attention kernels for sm_90a, without a GPU.

Compiles the Triton kernels ahead of time for an H100/H200 target (Triton needs no device to
emit PTX) and runs the ``ptxas -v`` shipped in the triton wheel on the PTX. Spills (local
memory) are what turned the first tiered decode kernel into 0.03x of bf16 on the H200; this
shows them before a GPU run. Shape: Llama-3-8B attention (32 query heads, 8 kv heads, D 128),
bf16 queries, page size 16 unless given.

Usage (CPU host; ~20-60 s per kernel; ``--help`` for the arguments)::

    # the GPU host's Triton (3.6): unpack its wheel, put it first on the path
    python -m pip download --no-deps triton==3.6.0 -d /tmp/whl && unzip -q -o /tmp/whl/triton-3.6.0-*.whl -d /tmp/tri36
    PYTHONPATH=/tmp/tri36 .venv/bin/python bench/kernels/ptxas_usage.py decode 64,4,2 64,8,2 16,4,2
    PYTHONPATH=/tmp/tri36 .venv/bin/python bench/kernels/ptxas_usage.py extend 128,64,8,2 128,128,8,3

Kernels and their launch tuples: ``decode`` / ``bf16-decode`` block_n,warps,stages[,page]
(``_decode_tiered_kernel`` / ``_decode_split_kernel`` on bf16 pages); ``extend`` /
``bf16-extend`` block_m,block_n,warps,stages[,page] (``_extend_tiered_kernel`` / ``_extend_kernel``).
Triton other than 3.6 emits PTX newer than its bundled ptxas reads; ``ptxas-blackwell`` is
used then. The counts are per thread; 255 registers x 128 threads = half an SM's registers.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from radixlm.kernels import decode_attention as decode_mod  # noqa: E402
from radixlm.kernels import extend_attention as extend_mod  # noqa: E402

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
if not triton.__version__.startswith("3.6"):
    PTXAS += "-blackwell"  # newer PTX versions
POINTERS = {
    "Q": "*bf16", "KPool": "*fp8e4nv", "VPool": "*fp8e4nv", "PageTable": "*i32", "SeqLens": "*i32",
    "Out": "*bf16", "PartOut": "*fp32", "PartLse": "*fp32", "KScale": "*fp32", "VScale": "*fp32",
    "VMean": "*fp32", "FSlot": "*i32", "KCodes": "*u8", "KStat": "*fp16", "VCodes": "*u8", "VStat": "*fp16",
    "CuExtend": "*i32", "PrefixLens": "*i32", "SinkK": "*fp32", "SinkV": "*fp32", "SinkSlots": "*i32",
}  # fmt: skip
GROUP, KV_HEADS, HEAD_DIM, VGROUP = 4, 8, 128, 64


def usage(fn, pointers: dict, constexprs: dict, num_warps: int, num_stages: int) -> str:
    """``ptxas -v`` summary (registers, spill bytes) and Triton's shared memory bytes."""
    sig = {n: "constexpr" if n in constexprs else pointers.get(n, "fp32" if n == "qk_scale_log2" else "i32")
           for n in fn.arg_names}  # fmt: skip
    kernel = triton.compile(
        ASTSource(fn=fn, signature=sig, constexprs=constexprs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    run = subprocess.run([PTXAS, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull],
                         capture_output=True, text=True, check=False)  # fmt: skip
    os.unlink(f.name)
    lines = [ln.split(":", 1)[-1].strip() for ln in (run.stdout + run.stderr).splitlines()
             if "Used" in ln or "spill" in ln or "rror" in ln]  # fmt: skip
    return " | ".join(lines) + f" | shared {kernel.metadata.shared} B"


KERNELS = ("decode", "bf16-decode", "extend", "bf16-extend")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kernel", choices=KERNELS, help="decode / extend: the tiered (int4 / mixed) kernels; "
                    "bf16-decode / bf16-extend: the float-page kernels")
    ap.add_argument("configs", nargs="+", metavar="CONFIG",
                    help="decode: block_n,warps,stages[,page]; extend: block_m,block_n,warps,stages[,page]")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    which, configs = args.kernel, [tuple(int(x) for x in c.split(",")) for c in args.configs]
    bf16 = dict(POINTERS, KPool="*bf16", VPool="*bf16")
    for cfg in configs:
        if which in ("decode", "bf16-decode"):
            block_n, warps, stages, *rest = cfg
            page = rest[0] if rest else 16
            common = dict(GROUP=GROUP, BLOCK_H=16, BLOCK_N=block_n, HEAD_DIM=HEAD_DIM, PAGE_SIZE=page,
                          DIRECT=False, DOT_PRECISION="tf32", CENTER=False)  # fmt: skip
            if which == "decode":
                aligned, step = decode_mod._tiled_step(page, block_n)
                info = usage(decode_mod._decode_tiered_kernel, POINTERS,
                             dict(common, NUM_KV_HEADS=KV_HEADS, VGROUP=VGROUP, ALIGNED=aligned, STEP=step),
                             warps, stages)  # fmt: skip
            else:
                info = usage(decode_mod._decode_split_kernel, bf16,
                             dict(common, QUANT=0, F16_DOT=False, PAGES_AHEAD=False, SAME_STRIDES=True,
                                  HAS_SINK=False, V_CHANNEL_MAJOR=False, VSTEP=min(page, block_n)),
                             warps, stages)  # fmt: skip
        elif which in ("extend", "bf16-extend"):
            block_m, block_n, warps, stages, *rest = cfg
            page = rest[0] if rest else 16
            common = dict(GROUP=GROUP, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=HEAD_DIM, PAGE_SIZE=page,
                          DOT_PRECISION="tf32", REVERSE_M=True)  # fmt: skip
            if which == "extend":
                aligned, step = decode_mod._tiled_step(page, block_n)
                info = usage(extend_mod._extend_tiered_kernel, POINTERS,
                             dict(common, NUM_KV_HEADS=KV_HEADS, VGROUP=VGROUP, ALIGNED=aligned, STEP=step),
                             warps, stages)  # fmt: skip
            else:
                info = usage(extend_mod._extend_kernel, bf16,
                             dict(common, SCALE_MODE=1, WARP_SPEC=False, PROBE=0, QUANT=0, F16_DOT=False,
                                  HAS_SINK=False, V_CHANNEL_MAJOR=False, VSTEP=min(page, block_n)),
                             warps, stages)  # fmt: skip
        print(f"{which} {cfg} triton {triton.__version__}: {info}", flush=True)


if __name__ == "__main__":
    main()
