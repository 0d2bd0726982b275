"""``--radix-eviction-policy`` reaches the scheduler's radix tree."""

from __future__ import annotations

import pytest

from radixlm.runtime.scheduler import Scheduler
from radixlm.runtime.server_args import ServerArgs


class TinyRunner:
    """What the Scheduler constructor reads from a model runner."""

    num_pages = 9
    tokenizer = None
    eos_token_ids = {2}
    context_length = 128


def test_flag_parses_and_rejects_unknown_policies(capsys: pytest.CaptureFixture) -> None:
    assert ServerArgs.parse([]).radix_eviction_policy == "lru"
    assert ServerArgs.parse(["--radix-eviction-policy", "importance"]).radix_eviction_policy == (
        "importance"
    )
    with pytest.raises(SystemExit) as exit_info:
        ServerArgs.parse(["--radix-eviction-policy", "fifo"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'fifo'" in capsys.readouterr().err


@pytest.mark.parametrize("policy", ["lru", "lfu", "longest", "importance"])
def test_scheduler_builds_its_tree_with_the_policy(policy: str) -> None:
    scheduler = Scheduler(ServerArgs(radix_eviction_policy=policy), TinyRunner())
    assert scheduler.cache.tree is not None
    assert scheduler.cache.tree.eviction_policy == policy


def test_no_tree_without_the_radix_cache() -> None:
    args = ServerArgs(radix_eviction_policy="longest", disable_radix_cache=True)
    assert Scheduler(args, TinyRunner()).cache.tree is None
