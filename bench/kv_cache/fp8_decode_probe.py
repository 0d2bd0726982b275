"""Where FP8 paged decode attention loses its 2x: variants of the split kernel timed side
by side on one GPU (the speed target: FP8 >= 1.6x bf16 pages at batch 32 x 32K).

The production kernel (``radixlm.kernels.decode_attention``) converts every FP8 K/V element
to fp16 in registers (one ``cvt.rn.f16x2.e4m3x2`` per two elements) and runs fp16 dots. This
probe times, on the same scattered pages (Llama-3-8B attention: 32 q heads, 8 kv heads,
D 128, page 16, bf16 queries):

* ``bf16``: the production kernel on bf16 pages (the baseline);
* ``bf16_d64``: the production kernel on bf16 pages of head dim 64, i.e. the same bytes per
  key as FP8 at D 128: what the FP8 kernel would take if it were memory-bound;
* ``fp8``: the production kernel on FP8 pages;
* ``probe:cvt``: this file's copy of the split kernel, converts as production (a check that
  the copy times like the original);
* ``probe:bits``: e4m3 -> fp16 by bit operations on the loaded bytes (sign to bit 15,
  exponent and mantissa shifted into place: the value times 2^-8, folded into the scales),
  no convert instruction;
* ``probe:qk8``: the QK^T dot on FP8 tensor cores (q quantised per query head to e4m3 with
  its own scale, K used as stored), V converted as production;
* ``probe:qk8pv8``: both dots in FP8 (p scaled by 256 and rounded to e4m3, as FlashAttention-3's
  FP8 path does for P);
* ``prod:...``: the production kernel with other launch parameters (``DecodeConfig``:
  block_n, warps, stages, programs per SM, ``pages_ahead``).

Probe MODEs also include ``prefetch`` (the next tile's K/V loaded into registers one
iteration ahead) and ``pages_ahead`` (the next tile's page-table entries and offsets
computed one iteration ahead: what the production kernel now does). The relative error of
each variant against the float32 reference on the same FP8 pages is taken at batch 4 x 8K.
GPU times: bench_kernels.Timer (CUDA-graph replay, L2 flushed, median). The JSON also
records each probe kernel's registers, spills, shared memory and its PTX's ``cp.async``
count (whether Triton's software pipeliner staged the loads).

Usage (H200: ~1-2 minutes)::

    . bench/gpu_env.sh && python3 bench/kv_cache/fp8_decode_probe.py --out $OUT \
        [--shapes 1x2048,8x8192,32x8192,32x32768,128x8192] \
        [--probe-variants cvt:128:4:2:4,bits:128:4:2:4,qk8:128:4:2:4,pages_ahead:64:2:3:4] \
        [--prod-variants fp8:128:4:2:4:-,fp8:64:2:3:4:a,fp8:32:1:3:8:a]

``--ncu``: each kernel launched once per shape, untimed, for Nsight Compute::

    ncu --clock-control none --kernel-name regex:_decode_split_kernel --set full \
        python3 bench/kv_cache/fp8_decode_probe.py --ncu --shapes 32x32768 --out $OUT --prod-variants ''

``--plot RESULT.json [OLD.json]``: no run; draws RESULT.png, decode time per shape of bf16
pages and FP8 pages (``fp8t``: channel-major V; ``fp8``: row-major), taking the row-major
FP8 times from OLD.json where given (a run with the earlier defaults).

``--smoke``: tiny shapes under TRITON_INTERPRET=1 on the CPU (errors only). What it found:
BENCHMARKS.md, "Quantised KV cache: speed".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import triton
import triton.language as tl

BENCH = Path(__file__).resolve().parents[1]  # bench/: its topic folders hold shared helpers
sys.path[:0] = [str(BENCH / d) for d in ("kernels",)]
from bench_kernels import Timer, _kernel_info, rel_err  # noqa: E402

from radixlm.kernels import reference  # noqa: E402
from radixlm.kernels.decode_attention import (  # noqa: E402
    LOG2E,
    DecodeConfig,
    DecodeWorkspace,
    _decode_merge_kernel,
    decode_attention,
    decode_num_splits,
)

FP8 = torch.float8_e4m3fn


@triton.jit
def _probe_split_kernel(
    Q, KPool, VPool, PageTable, SeqLens, PartOut, PartLse, KScale, VScale,
    qk_scale_log2, num_splits,
    stride_qb, stride_qh, stride_kp, stride_ks, stride_kk, stride_ptb,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, MODE: tl.constexpr,
):  # fmt: skip
    """MODE 0: convert to fp16 (production); 1: bit-operation convert (pools passed as
    uint8); 2: QK on FP8 tensor cores; 3: both dots on FP8 tensor cores; 4: as 0 with the
    next tile's K/V loaded one iteration ahead into registers; 5: as 0 with the next
    tile's page-table entries loaded ahead."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    k_scale = tl.load(KScale + kv_head)
    v_scale = tl.load(VScale + kv_head)
    if MODE == 1:  # the bit convert yields value * 2^-8
        k_scale = k_scale * 256.0
        v_scale = v_scale * 256.0
    seq_len = tl.load(SeqLens + b)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    rows = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + rows
    head_mask = rows < GROUP
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=head_mask[:, None],
                other=0.0).to(tl.float32)  # fmt: skip
    qk = qk_scale_log2 * k_scale
    if MODE == 2 or MODE == 3:  # q per query head to e4m3: q = q8 * q_s
        q_amax = tl.max(tl.abs(q), 1)
        q_s = tl.where(q_amax > 0, q_amax / 448.0, 1.0)
        q8 = (q / q_s[:, None]).to(tl.float8e4nv)
        qk_row = qk * q_s  # [Hb]
    else:
        q16 = tl.minimum(tl.maximum(q, -65504.0), 65504.0).to(tl.float16)
    page_row = PageTable + b * stride_ptb
    k_base = KPool + kv_head * stride_kk
    v_base = VPool + kv_head * stride_kk
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    # MODE 4: the next tile's pages, K and V loaded one iteration ahead (register
    # prefetch); MODE 5: only the page-table entries one tile ahead.
    keys = start + tl.arange(0, BLOCK_N)
    page_n = tl.load(page_row + keys // PAGE_SIZE, mask=keys < end, other=0).to(tl.int64)
    off_n = page_n * stride_kp + (keys % PAGE_SIZE) * stride_ks
    if MODE == 4:
        k_n = tl.load(k_base + off_n[:, None] + dims[None, :], mask=(keys < end)[:, None], other=0.0)
        v_n = tl.load(v_base + off_n[:, None] + dims[None, :], mask=(keys < end)[:, None], other=0.0)
    for n0 in range(start, end, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        valid = keys < end
        if MODE >= 4:
            off = off_n
            nk = keys + BLOCK_N
            page_n = tl.load(page_row + nk // PAGE_SIZE, mask=nk < end, other=0).to(tl.int64)
            off_n = page_n * stride_kp + (nk % PAGE_SIZE) * stride_ks
            if MODE == 4:
                k = k_n
                v_cur = v_n
                k_n = tl.load(k_base + off_n[:, None] + dims[None, :], mask=(nk < end)[:, None], other=0.0)
                v_n = tl.load(v_base + off_n[:, None] + dims[None, :], mask=(nk < end)[:, None], other=0.0)
            else:
                k = tl.load(k_base + off[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
        else:
            page = tl.load(page_row + keys // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
            off = page * stride_kp + (keys % PAGE_SIZE) * stride_ks
            k = tl.load(k_base + off[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
        if MODE == 2 or MODE == 3:
            s = tl.dot(q8, tl.trans(k)) * qk_row[:, None]
        else:
            if MODE == 1:
                k16 = k.to(tl.uint16)
                k = (((k16 & 0x80) << 8) | ((k16 & 0x7F) << 7)).to(tl.float16, bitcast=True)
            else:
                k = k.to(tl.float16)
            s = tl.dot(q16, tl.trans(k)) * qk
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        if MODE == 4:
            v = v_cur
        else:
            v = tl.load(v_base + off[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
        if MODE == 3:
            p8 = (p * 256.0).to(tl.float8e4nv)
            l_i = l_i * alpha + tl.sum(p8.to(tl.float32), 1) * (1.0 / 256.0)
            acc = acc * alpha[:, None] + tl.dot(p8, v) * (1.0 / 256.0)
        else:
            l_i = l_i * alpha + tl.sum(p, 1)
            if MODE == 1:
                v16 = v.to(tl.uint16)
                v = (((v16 & 0x80) << 8) | ((v16 & 0x7F) << 7)).to(tl.float16, bitcast=True)
            else:
                v = v.to(tl.float16)
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)
        m_i = m_new
    nonempty = l_i > 0.0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None] * v_scale
    row = (b * GROUP * tl.num_programs(1) + heads) * num_splits + split
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    tl.store(PartOut + row[:, None] * HEAD_DIM + dims[None, :], out, mask=head_mask[:, None])
    tl.store(PartLse + row, lse, mask=head_mask)


def kernel_info(kernel) -> dict:
    """bench_kernels' registers / spills / shared memory of a compiled kernel, plus its PTX's
    async-copy and global-load counts (cp.async present = Triton's software pipeliner staged
    a load through shared memory)."""
    ptx = kernel.asm.get("ptx", "")
    return {**_kernel_info(kernel), "cp_async": ptx.count("cp.async.ca") + ptx.count("cp.async.cg"),
            "ld_global": ptx.count("ld.global")}  # fmt: skip


def probe_decode(q, k8, v8, table, seq, scale, ks, vs, mode, block_n, num_warps, splits, ws, out, stages=2,
                 info=None):  # fmt: skip
    batch, heads, dim = q.shape
    kv_heads = k8.shape[2]
    group = heads // kv_heads
    kp, vp = (k8.view(torch.uint8), v8.view(torch.uint8)) if mode == 1 else (k8, v8)
    kernel = _probe_split_kernel[(batch, kv_heads, splits)](
        q, kp, vp, table, seq, ws.partial_out, ws.partial_lse, ks, vs, scale * LOG2E, splits,
        q.stride(0), q.stride(1), k8.stride(0), k8.stride(1), k8.stride(2), table.stride(0),
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, HEAD_DIM=dim,
        PAGE_SIZE=k8.shape[1], MODE=mode, num_warps=num_warps, num_stages=stages,
    )  # fmt: skip
    if info is not None and not info and kernel is not None:
        info.update(kernel_info(kernel))
    _decode_merge_kernel[(batch, heads)](
        ws.partial_out, ws.partial_lse, out, seq, splits, out.stride(0), out.stride(1),
        HEAD_DIM=dim, BLOCK_S=triton.next_power_of_2(splits), GROUP=group, CENTER=False,
        num_warps=4 if dim * splits >= 4096 else 2,
    )  # fmt: skip
    return out


MODES = {"cvt": 0, "bits": 1, "qk8": 2, "qk8pv8": 3, "prefetch": 4, "pages_ahead": 5}


def parse_variants(text: str) -> list[tuple]:
    """"a:1:2,b:3:4" -> [("a", 1, 2), ("b", 3, 4)] (numbers as int, "a"/"-" as True/False)."""
    out = []
    for item in filter(None, text.split(",")):
        name, *nums = item.split(":")
        out.append((name, *(n == "a" if n in ("a", "-") else int(n) for n in nums)))
    return out


def shape_runs(q, pools: dict, table, seq, scale, probe: list, prod: list, kernels: dict, memory_bound: bool):
    """{name: fn} of one shape: the production kernel's defaults on bf16 and FP8 pages, the
    bf16 half-head-dim proxy (``memory_bound``), the probe variants and the production
    launch variants."""
    (k, v), (k8, v8, ks, vs) = pools["bf16"], pools["fp8"]
    batch, heads, dim = q.shape
    kv_heads, device = k.shape[2], q.device
    runs = {
        "bf16": lambda: decode_attention(q, k, v, table, seq, scale),
        "fp8": lambda: decode_attention(q, k8, v8, table, seq, scale, k_scale=ks, v_scale=vs),
    }
    if "fp8t" in pools:  # V pages channel-major
        runs["fp8t"] = lambda: decode_attention(q, k8, pools["fp8t"][1], table, seq, scale, k_scale=ks, v_scale=vs)
    if memory_bound:
        k64, v64, q64 = (x[..., : dim // 2].contiguous() for x in (k, v, q))
        runs["bf16_d64"] = lambda: decode_attention(q64, k64, v64, table, seq, scale)
    for mode, bn, w, st, pps in probe:
        out = torch.empty_like(q)
        n = decode_num_splits(batch, kv_heads, table.shape[1] * k.shape[1], device,
                              DecodeConfig(block_n=bn, programs_per_sm=pps))  # fmt: skip
        ws = DecodeWorkspace.allocate(batch, heads, n, dim, device)
        name = f"probe:{mode}:n{bn}w{w}s{st}p{pps}"
        info = kernels.setdefault(name, {})
        runs[name] = lambda mode=mode, bn=bn, w=w, st=st, out=out, info=info, n=n, ws=ws: probe_decode(
            q, k8, v8, table, seq, scale, ks, vs, MODES[mode], bn, w, n, ws, out, st, info)
    for pool, bn, w, st, pps, ahead, *regs in prod:
        cfg = DecodeConfig(block_n=bn, num_warps=w, num_stages=st, programs_per_sm=pps, pages_ahead=ahead,
                           max_registers=regs[0] if regs else None)  # fmt: skip
        kk, vv, a, c = (k, v, None, None) if pool == "bf16" else pools[pool]
        runs[f"prod:{pool}:n{bn}w{w}s{st}p{pps}{'a' if ahead else ''}{f'r{regs[0]}' if regs else ''}"] = (
            lambda kk=kk, vv=vv, a=a, c=c, cfg=cfg: decode_attention(
                q, kk, vv, table, seq, scale, config=cfg, k_scale=a, v_scale=c))  # fmt: skip
    return runs


def plot(result: Path, old: Path | None = None) -> Path:
    """Grouped bars of the decode time (us) per batch x context: bf16 pages, FP8 row-major V
    (``fp8``, from ``old`` when given) and FP8 channel-major V (``fp8t``), with the FP8
    speedups over bf16 written above the bars. Returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = json.loads(result.read_text())["rows"]
    old_rows = {(r["batch"], r["context"]): r["us"] for r in json.loads(old.read_text())["rows"]} if old else {}
    rows = sorted((r for r in rows if isinstance(r["us"].get("fp8t"), float)), key=lambda r: r["batch"] * r["context"])
    labels = [f"{r['batch']} x {r['context'] // 1024}K" for r in rows]
    series = {
        "bf16 pages": [r["us"]["bf16"] for r in rows],
        "FP8, row-major V": [old_rows.get((r["batch"], r["context"]), r["us"])["fp8"] for r in rows],
        "FP8, channel-major V": [r["us"]["fp8t"] for r in rows],
    }
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.27
    for i, (name, values) in enumerate(series.items()):
        xs = [j + (i - 1) * width for j in range(len(rows))]
        ax.bar(xs, values, width, label=name)
        if i:
            for x, v, b in zip(xs, values, series["bf16 pages"], strict=True):
                ax.text(x, v, f"{b / v:.2f}x", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(rows)), labels)
    ax.set_xlabel("batch x keys per request")
    ax.set_ylabel("decode attention, us (lower is better)")
    ax.set_title("Paged decode attention on an H200: Llama-3-8B heads, page 16 (labels: speedup over bf16)")
    ax.legend()
    out = result.with_suffix(".png")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plot", nargs="+", metavar="JSON", type=Path,
                    help="no run: RESULT.json [OLD.json] -> RESULT.png (see the module docstring)")
    ap.add_argument("--out", default=Path(__file__).resolve().parents[2] / "bench" / "results" / "fp8_decode_probe",
                    help="output directory (default: bench/results/fp8_decode_probe/)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--ncu", action="store_true",
                    help="launch each kernel once per shape, untimed and without the check shape "
                         "(for ncu --kernel-name regex:_decode_split_kernel)")  # fmt: skip
    ap.add_argument("--shapes", default="1x2048,8x8192,32x8192,32x32768,128x8192", help="BATCHxCONTEXT,...")
    ap.add_argument("--probe-variants", default="",
                    help="this file's kernel: MODE:BLOCK_N:WARPS:STAGES:PROGRAMS_PER_SM,... "
                         "(MODE: cvt, bits, qk8, qk8pv8, prefetch, pages_ahead)")  # fmt: skip
    ap.add_argument("--prod-variants", help="the production kernel: POOL:BLOCK_N:WARPS:STAGES:PROGRAMS_PER_SM:a|-[:MAX_REGISTERS],...",
                    default="fp8:128:4:2:4:-,fp8:128:4:3:4:a,fp8:64:2:3:4:a,fp8:32:1:3:8:a")  # fmt: skip
    args = ap.parse_args()
    if args.plot:
        if len(args.plot) > 2:
            ap.error("--plot takes RESULT.json and at most one OLD.json")
        print(plot(args.plot[0], args.plot[1] if len(args.plot) > 1 else None))
        return
    smoke = args.smoke
    device = torch.device("cpu" if smoke else "cuda")
    heads, kv_heads, dim, page = (8, 2, 32, 16) if smoke else (32, 8, 128, 16)
    shapes = [(2, 64)] if smoke else [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    check = (2, 64) if smoke else (4, 8192)
    base = torch.float16 if smoke else torch.bfloat16
    gen = torch.Generator(device="cpu").manual_seed(0)
    most = max(b * c for b, c in shapes + [check])
    pages = most // page + 2
    shape = (pages, page, kv_heads, dim)
    k = torch.randn(shape, generator=gen).to(device, base)
    k[..., :4] *= 8
    v = torch.randn(shape, generator=gen).to(device, base)
    ks = k.float().abs().amax(dim=(0, 1, 3)) * 2 / 448
    vs = v.float().abs().amax(dim=(0, 1, 3)) * 2 / 448
    k8, v8 = torch.empty(shape, dtype=FP8, device=device), torch.empty(shape, dtype=FP8, device=device)
    for i in range(0, pages, 4096):
        k8[i : i + 4096] = reference.quantize_fp8(k[i : i + 4096], ks)
        v8[i : i + 4096] = reference.quantize_fp8(v[i : i + 4096], vs)
    v8t = v8.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)  # [P, K, D, S] in memory
    pools = {"bf16": (k, v), "fp8": (k8, v8, ks, vs), "fp8t": (k8, v8t, ks, vs)}
    timer = Timer(device, budget_s=0.5 if not smoke else 0.01)
    scale = dim**-0.5
    results: dict = {"device": torch.cuda.get_device_name() if not smoke else "cpu", "rows": [], "kernels": {},
                     "args": vars(args)}  # fmt: skip
    probe, prod = parse_variants(args.probe_variants), parse_variants(args.prod_variants)
    if smoke:
        probe = [(m, 16, 4, 2, 4) for m in MODES]
        prod = [("bf16", 16, 4, 2, 4, True), ("fp8", 16, 2, 3, 4, True), ("fp8", 16, 2, 3, 4, False),
                ("fp8t", 16, 1, 3, 8, True)]
    for batch, ctx in ([] if args.ncu else [check]) + shapes:
        need = -(-ctx // page)
        perm = torch.randperm(pages - 1, generator=gen)[: batch * need] + 1
        table = perm.view(batch, need).to(torch.int32).to(device)
        seq = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        q = torch.randn(batch, heads, dim, generator=gen).to(device, base)
        row: dict = {"batch": batch, "context": ctx, "us": {}, "rel_err": {}}
        is_check = (batch, ctx) == check
        ref = reference.paged_decode_attention(q, k8, v8, table, seq, scale, ks, vs) if is_check else None
        runs = shape_runs(q, pools, table, seq, scale, probe, prod, results["kernels"], not smoke)
        for name, fn in runs.items():
            try:
                got = fn().clone()
                if is_check and name != "bf16_d64":
                    row["rel_err"][name] = rel_err(got, ref)
                if not (smoke or args.ncu):
                    row["us"][name] = timer.median_us(fn, graph=True)
            except Exception as exc:  # noqa: BLE001 - a variant that fails to compile is recorded
                row["us"][name] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(batch, ctx, name, row["us"].get(name), row["rel_err"].get(name), flush=True)
        results["rows"].append(row)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "fp8_decode_probe.json").write_text(json.dumps(results, indent=1))
    for name, info in results["kernels"].items():
        print(name, info)


if __name__ == "__main__":
    main()
