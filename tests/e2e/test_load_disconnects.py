"""Load with client disconnects, CI size: bench/reliability/load_disconnects.py's own
functions (imported, one implementation) on real servers.

80 concurrent requests over 8 prompts (4 shared prefixes), mixing /generate,
/v1/completions and /v1/chat/completions, streaming and not, greedy; a quarter are cut by
the client (before the first byte or token, mid-stream, non-streaming client timeout).
The load server has a small KV pool (2,048 tokens, 128 pages), so admission waits and the
radix tree evicts while requests come and go. Afterwards: nothing lost, no 5xx, the server
idle with no page leaked and no lock held, idle memory back to its level before the load,
and every completed request equal to its reference (sent alone on a fresh server with the
radix cache off; differences only at documented near-ties, rule of case C01).
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "reliability" / "load_disconnects.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("load_disconnects", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


ld = _load_script()
LOADS = [  # the suite's size on a small pool, and the soak's: the script's defaults (500 requests, 8,192-token pool)
    pytest.param(ld.LoadConfig(requests=80, prompts=8, max_new_tokens=8, max_cut_delay_s=4.0, seed=7),
                 dict(max_total_tokens=2048, chunked_prefill_size=512), id="80", marks=pytest.mark.slow),
    pytest.param(ld.LoadConfig(), dict(max_total_tokens=8192, chunked_prefill_size=512), id="500",
                 marks=pytest.mark.soak),
]


@pytest.mark.parametrize(("cfg", "flags"), LOADS)
def test_load_with_disconnects_loses_nothing_and_leaks_nothing(server_factory, idle_invariants, cfg, flags):
    plan = ld.make_plan(cfg)
    planned = {s.cut for s in plan if s.cut}
    assert planned == set(ld.CUTS) and len({(s.api, s.stream) for s in plan}) == 6
    start = time.monotonic()
    with server_factory(**flags) as srv:
        load = ld.run_load_phase(srv.url, cfg, srv.proc.pid)
        idle_invariants(srv)
        assert "Traceback" not in srv.log(), srv.log()[-3000:]
    loaded = time.monotonic()
    with server_factory(disable_radix_cache=True, **flags) as ref:
        refs = ld.compute_references(ref.url, plan, load.outcomes, ld.make_prompts(cfg))
    times = f"load server {loaded - start:.0f} s, reference server {time.monotonic() - loaded:.0f} s"
    s = ld.summarize(cfg, load, refs)
    figures = {k: s[k] for k in ("completed", "disconnected", "disconnected_by_kind", "lost", "http_5xx",
                                 "pages_leaked", "evicted_pages", "preemptions", "references", "near_ties",
                                 "output_mismatches", "prepare_s", "wall_s", "rss_idle_before_mib", "rss_peak_mib",
                                 "rss_idle_after_mib")}
    print(f"\nload with disconnects ({times}): {figures}")
    assert s["requests_sent"] == cfg.requests
    assert s["lost"] == 0, s["lost_examples"]
    assert s["http_5xx"] == 0
    assert s["completed"] + s["disconnected"] == cfg.requests
    # The load really cut requests at several points (a cut that comes after the whole
    # answer is no disconnect, so not every planned one happens).
    assert s["disconnected"] >= s["planned_cuts"] // 2 and len(s["disconnected_by_kind"]) >= 2, s
    assert s["idle"] and s["running_after"] == 0 and s["waiting_after"] == 0
    assert s["pages_leaked"] == 0 and s["locked_pages_after"] == 0
    assert s["invariants_ok"] and s["invariant_violations"] == []
    assert s["checked_outputs"] >= cfg.requests // 2 and s["references"] >= cfg.prompts
    mismatches = [d for d in s["differences"] if d["verdict"] == "mismatch"]
    assert mismatches == [], mismatches[:3]
    assert s["rss_idle_after_mib"] <= s["rss_idle_before_mib"] + cfg.rss_tolerance_mib, figures
    assert ld.failures(s) == []
