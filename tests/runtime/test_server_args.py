"""ServerArgs: the security-relevant defaults and the RADIXLM_API_KEY variable."""

from __future__ import annotations

import pytest

from radixlm.runtime.server_args import ServerArgs


def test_defaults_bind_loopback_and_limit_bodies_but_not_the_queue(monkeypatch):
    monkeypatch.delenv("RADIXLM_API_KEY", raising=False)
    for args in (ServerArgs(), ServerArgs.parse([])):
        assert args.host == "127.0.0.1"
        assert args.api_key is None
        assert args.max_request_body_bytes == 32 * 2**20
        assert args.max_queued_requests is None


def test_api_key_from_the_environment_unless_the_flag_is_given(monkeypatch):
    monkeypatch.setenv("RADIXLM_API_KEY", "sk-from-env")
    assert ServerArgs.parse([]).api_key == "sk-from-env"
    assert ServerArgs.parse(["--api-key", "sk-from-flag"]).api_key == "sk-from-flag"
    assert ServerArgs().api_key is None  # code that builds ServerArgs does not read the environment


def test_api_key_stays_out_of_repr():
    args = ServerArgs(api_key="sk-secret-value")
    assert "sk-secret-value" not in repr(args) and "sk-secret-value" not in str(args)


@pytest.mark.parametrize("key", ["", "two words", "tab\there", "ключ"])
def test_unusable_api_key_is_a_usage_error(monkeypatch, capsys, key):
    monkeypatch.delenv("RADIXLM_API_KEY", raising=False)
    with pytest.raises(SystemExit) as exc:
        ServerArgs.parse(["--api-key", key])
    assert exc.value.code == 2 and "--api-key" in capsys.readouterr().err
    monkeypatch.setenv("RADIXLM_API_KEY", key)  # loud on a bad environment value too
    with pytest.raises(SystemExit) as exc:
        ServerArgs.parse([])
    assert exc.value.code == 2 and "RADIXLM_API_KEY" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--max-queued-requests", "-1"], "--max-queued-requests must be >= 0"),
    (["--max-request-body-bytes", "0"], "--max-request-body-bytes must be >= 1"),
    (["--admit-batch-size", "0"], "--admit-batch-size must be >= 1"),
    (["--admit-max-wait-steps", "-1"], "--admit-max-wait-steps must be >= 0"),
    (["--num-scheduler-steps", "0"], "--num-scheduler-steps must be in [1, 64]"),
    (["--num-scheduler-steps", "65"], "--num-scheduler-steps must be in [1, 64]"),
    # from an adversarial pass: accepted before, or failing only after the model loaded
    (["--context-length", "-5"], "--context-length must be >= 1"),
    (["--context-length", "0"], "--context-length must be >= 1"),
    (["--stream-interval", "0"], "--stream-interval must be >= 1"),
    (["--port", "70000"], "--port must be in 1..65535"),
    (["--port", "-1"], "--port must be in 1..65535"),
    (["--swap-space-gb", "-1"], "--swap-space-gb must be a finite number >= 0"),
    (["--schedule-max-wait-s", "nan"], "--schedule-max-wait-s must be a finite number >= 0"),
    (["--importance-weights", "1,nan,2"], "three comma-separated finite numbers"),
    (["--importance-weights", "1,2"], "three comma-separated finite numbers"),
    (["--random-seed", "99999999999999999999999"], "--random-seed must be in [0, 2**63)"),
    (["--kv-events-endpoint", "localhost:5557"], "--kv-events-endpoint must be tcp://host:port"),
    (["--kv-events-replay-endpoint", "tcp://*:5558"], "--kv-events-replay-endpoint needs --kv-events-endpoint"),
    (["--kv-events-endpoint", "tcp://*:5557", "--disable-radix-cache"], "drop --disable-radix-cache"),
    # the rendezvous port: torch.distributed refused it only after the ranks had loaded the model
    (["--tp-size", "3", "--dist-init-addr", "127.0.0.1:99999"], "ports 99999..99999 must lie in 1..65535"),
    (["--tp-size", "3", "--dist-init-addr", "127.0.0.1:0"], "--dist-init-addr: ports 0..0"),
    (["--dp-size", "2", "--dist-init-addr", "127.0.0.1:65535"], "ports 65535..65536"),
    (["--dp-size", "2", "--enable-peer-kv", "--dist-init-addr", "h:65534"], "ports 65534..65536"),
    (["--dp-size", "2", "--dp-balance-abs", "-1"], "--dp-balance-abs must be >= 0"),
    (["--hicache-storage-dir", "/tmp/kv", "--hicache-storage-size-gb", "0"],
     "--hicache-storage-size-gb must be > 0 with --hicache-storage-dir"),
])
def test_limit_flags_out_of_range_are_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        ServerArgs.parse(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_dist_init_addr_may_end_at_the_last_port():
    assert ServerArgs.parse(["--dp-size", "2", "--dist-init-addr", "127.0.0.1:65534"]).dist_init_addr.endswith("65534")
    assert ServerArgs.parse(["--tp-size", "3", "--dist-init-addr", "127.0.0.1:65535"]).tp_size == 3


def test_num_scheduler_steps_defaults_to_one_step():
    assert ServerArgs.parse([]).num_scheduler_steps == 1
    assert ServerArgs.parse(["--num-scheduler-steps", "8"]).num_scheduler_steps == 8


def test_zero_queue_is_allowed():
    assert ServerArgs.parse(["--max-queued-requests", "0"]).max_queued_requests == 0


@pytest.mark.parametrize("value", ["1", "15", "-1", "8193"])
def test_piecewise_cuda_graph_max_tokens_range(capsys, value):
    assert ServerArgs.parse(["--piecewise-cuda-graph-max-tokens", "0"]).piecewise_cuda_graph_max_tokens == 0
    assert ServerArgs.parse(["--piecewise-cuda-graph-max-tokens", "16"]).piecewise_cuda_graph_max_tokens == 16
    assert ServerArgs.parse([]).piecewise_cuda_graph_max_tokens == 1024
    with pytest.raises(SystemExit) as exc:
        ServerArgs.parse(["--piecewise-cuda-graph-max-tokens", value])
    assert exc.value.code == 2 and "--piecewise-cuda-graph-max-tokens" in capsys.readouterr().err


def test_max_prefill_tokens_may_be_below_the_running_batch(capsys):
    args = ServerArgs.parse(["--max-prefill-tokens", "192", "--max-running-requests", "1024"])
    assert (args.max_prefill_tokens, args.max_running_requests) == (192, 1024)
    with pytest.raises(SystemExit) as exc:
        ServerArgs.parse(["--max-prefill-tokens", "0"])
    assert exc.value.code == 2 and "--max-prefill-tokens must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["1", "-1", "513"])
def test_cuda_graph_max_extend_tokens_range(capsys, value):
    assert ServerArgs.parse(["--cuda-graph-max-extend-tokens", "0"]).cuda_graph_max_extend_tokens == 0
    assert ServerArgs.parse([]).cuda_graph_max_extend_tokens == 256
    with pytest.raises(SystemExit) as exc:
        ServerArgs.parse(["--cuda-graph-max-extend-tokens", value])
    assert exc.value.code == 2 and "--cuda-graph-max-extend-tokens" in capsys.readouterr().err


def test_help_shows_each_default_once():
    """A help text that names its default itself gets no "(default: ...)" appended; every
    other one does, even when it mentions "the default" in passing."""
    import argparse

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    helps = {a.option_strings[0]: a.help for a in parser._actions if a.option_strings}
    assert helps["--max-prefill-tokens"].endswith("(default: 4096)")
    assert helps["--mem-fraction-static"].endswith(f"(default: {ServerArgs.mem_fraction_static})")
    for flag in ("--admit-batch-size", "--idle-spin-ms", "--tokenizer-path", "--kv-mixed-window-pages"):
        assert "(default: None)" not in helps[flag], flag
    assert helps["--piecewise-cuda-graph-max-tokens"].endswith("(default: 1024)")


@pytest.mark.parametrize("argv, message", [
    (["--enable-peer-kv"], "--enable-peer-kv needs --dp-size >= 2"),
    (["--enable-peer-kv", "--dp-size", "2", "--tp-size", "2"], "does not support --tp-size > 1"),
    (["--enable-peer-kv", "--dp-size", "2", "--disable-radix-cache"], "--enable-peer-kv needs the radix cache"),
    (["--enable-peer-kv", "--dp-size", "2", "--kv-cache-dtype", "fp8_e4m3"], "float KV caches only"),
    (["--enable-peer-kv", "--dp-size", "2", "--kv-cache-dtype", "int4"], "float KV caches only"),
    (["--peer-kv-timeout-s", "-1"], "--peer-kv-timeout-s must be a finite number >= 0"),
    (["--peer-kv-min-wait-s", "inf"], "--peer-kv-min-wait-s must be a finite number >= 0"),
])
def test_peer_kv_flag_combinations_are_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        ServerArgs.parse(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_peer_kv_goes_with_data_parallelism_and_the_hierarchical_cache():
    args = ServerArgs.parse(["--enable-peer-kv", "--dp-size", "2", "--hicache-ratio", "2", "--kv-cache-dtype", "bf16"])
    assert args.enable_peer_kv and args.peer_kv_timeout_s == 1.0 and args.peer_kv_min_wait_s == 0.05
