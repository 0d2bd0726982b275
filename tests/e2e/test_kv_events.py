"""KV events from a real server (``--kv-events-endpoint``): a subscriber's view of the blocks,
built from the events alone, follows the server's radix tree through inserts, evictions
and a flush: its block count equals the tree's cached pages, and its longest match of a
prompt predicts the ``cached_tokens`` the server reports when the prompt comes again."""

from __future__ import annotations

import os
import random
import tempfile
import time
import uuid

import httpx

from radixlm.runtime import kv_events as kv

PAGE = 16


def _ipc(name: str) -> str:
    return f"ipc://{os.path.join(tempfile.gettempdir(), f'radixlm-e2e-{name}-{uuid.uuid4().hex[:8]}')}"


def _settled(srv, sub: kv.KVEventSubscriber, index: kv.KVBlockIndex, timeout: float = 15.0) -> int:
    """Wait until the server is idle and the subscriber's block count equals the tree's
    cached pages; returns that count (fails with both numbers after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        report = srv.wait_idle_invariants()
        held = index.num_blocks("server")
        if held == report["cached_pages"]:
            return held
        assert time.monotonic() < deadline, (held, report, sub.received)
        time.sleep(0.05)


def _generate(client: httpx.Client, ids: list[int], max_new: int = 4) -> dict:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}}
    return client.post("/generate", json=body).raise_for_status().json()


def test_kv_events_follow_the_radix_tree(server_factory, tiny_model_dir, smollm2_dir) -> None:
    endpoint, replay = _ipc("kv"), _ipc("kv-replay")
    index = kv.KVBlockIndex()
    with server_factory(model_path=tiny_model_dir("llama"), tokenizer_path=smollm2_dir, dtype="float32",
                        max_total_tokens=256, page_size=PAGE, kv_events_endpoint=endpoint,
                        kv_events_replay_endpoint=replay) as srv:
        sub = kv.KVEventSubscriber(endpoint, lambda batch: index.apply("server", batch), replay)
        try:
            rng = random.Random(0)
            prompts = [rng.choices(range(3, 256), k=64) for _ in range(6)]
            with srv.client() as client:
                _generate(client, prompts[0])
                assert _settled(srv, sub, index) == 4  # 64 prompt tokens: 4 full pages
                assert index.match(kv.block_hashes(prompts[0], PAGE)) == {"server": 4}
                for ids in prompts[1:]:  # 5 x 4 pages into a pool of 16: evictions
                    _generate(client, ids)
                held = _settled(srv, sub, index)
                assert 0 < held <= 16
                for ids in prompts:  # the index predicts each prompt's reuse
                    predicted = index.match(kv.block_hashes(ids, PAGE)).get("server", 0) * PAGE
                    got = _generate(client, ids, max_new=1)["meta_info"]["cached_tokens"]
                    assert got == min(predicted, len(ids) - PAGE), (predicted, got)  # the last token is recomputed
                    _settled(srv, sub, index)
                srv.flush()
                assert _settled(srv, sub, index) == 0
            assert sub.missed == 0 and sub.restarts == 0
            kinds = set()
            index2 = kv.KVBlockIndex()  # a late subscriber rebuilds the same view from the replay

            def late(batch: kv.EventBatch) -> None:
                kinds.update(type(e).__name__ for e in batch.events)
                index2.apply("server", batch)

            sub2 = kv.KVEventSubscriber(endpoint, late, replay)
            try:
                deadline = time.monotonic() + 10
                while sub2.next_seq < sub.next_seq and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert sub2.next_seq == sub.next_seq
            finally:
                sub2.close()
            assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
            assert index2.num_blocks("server") == 0
        finally:
            sub.close()
