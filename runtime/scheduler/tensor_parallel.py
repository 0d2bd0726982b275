"""Tensor parallelism between processes: rank 0 decides, every rank runs the step.

One replica with ``--tp-size`` P is P processes. Rank 0 is the scheduler process: radix
tree, planner, page allocator, sampling, outputs. Ranks 1..P-1 (``run_tp_worker_process``)
each hold a slice of the model and a KV pool of their kv heads with the same page ids;
they make no decision. Per step:

    rank 0 (Scheduler)                          rank r > 0 (TPWorker)
    plan -> ScheduleDecision
    LeaderRunner.launch: TPStep ----ZeroMQ----> mirror the requests (TPMirror)
    ModelRunner.launch                          ModelRunner.follow
      forward (all-reduce per layer)  <------>    forward (same collectives)
      logits (all-gather over the vocabulary) <-> logits
      sample; broadcast the ids  ------------->   ids -> inputs of the next step

The step channel (one PUSH socket per rank, msgspec ``TPStep``) carries the decision; the
tensors move through torch.distributed (gloo on the CPU, NCCL on CUDA). A rank that dies
leaves the others blocked in a collective: the launcher's watchdog sees the dead process
and stops the whole server (launch_server.py).
"""

from __future__ import annotations

import logging
import os
import signal
import weakref
from typing import Any

import zmq

from radixlm.runtime import messages as m
from radixlm.runtime.executor.model_runner import ModelRunner
from radixlm.runtime.executor.parallel import RankPlacement
from radixlm.runtime.ipc import MsgSocket
from radixlm.runtime.scheduler.decision import PendingStep, ScheduleDecision, ScheduleItem, SwapIn
from radixlm.runtime.scheduler.request import Req
from radixlm.runtime.server_args import ServerArgs

__all__ = ["LeaderRunner", "StepSender", "TPMirror", "run_tp_worker_process"]

logger = logging.getLogger("radixlm.tp")


class StepSender:
    """Rank 0's side of the step channel: turns decisions into ``TPStep`` messages, sending
    each request's prompt once and its output tokens as they become known."""

    def __init__(self, addrs: tuple[str, ...]) -> None:
        self.socks = [MsgSocket(zmq.PUSH, addr, bind=True) for addr in addrs]
        self.known: weakref.WeakKeyDictionary[Req, int] = weakref.WeakKeyDictionary()  # req -> outputs sent
        self.live: dict[str, Req] = {}

    def step(self, decision: ScheduleDecision, swaps: bool) -> m.TPStep:
        """The message of ``decision``'s swaps (``swaps``) or of its forward pass."""
        msg = m.TPStep(done=self._done())
        if swaps:
            msg.swap_out = [(req.rid, pages) for req, pages in decision.swap_out]
            msg.swap_in = [(s.req.rid, s.pages, s.first_page) for s in decision.swap_in]
            for req in [r for r, _ in decision.swap_out] + [s.req for s in decision.swap_in]:
                self._introduce(req, msg)
            return msg
        msg.decode_steps = decision.decode_steps
        for it in decision.items:
            req = it.req
            sent = self._introduce(req, msg)
            outputs = req.output_ids
            self.known[req] = len(outputs)
            msg.items.append(m.TPItem(req.rid, it.start, it.num_tokens, it.samples, outputs[sent:],
                                      req.num_inflight, req.pages, len(req.prompt_logprobs)))
        return msg

    def _introduce(self, req: Req, msg: m.TPStep) -> int:
        """Output tokens the other ranks have of ``req``; adds it to ``msg.new_reqs`` if new."""
        sent = self.known.get(req)
        if sent is None:
            msg.new_reqs.append(m.TPNewReq(req.rid, req.prompt_ids, req.return_logprob, req.logprob_start_len))
            self.live[req.rid] = req
            self.known[req] = sent = 0
        return sent

    def _done(self) -> list[str]:
        gone = [rid for rid, req in self.live.items() if req.finished]
        for rid in gone:
            del self.live[rid]
        return gone

    def send(self, msg: m.TPStep) -> None:
        for sock in self.socks:
            sock.send(msg)

    def close(self) -> None:
        for sock in self.socks:
            sock.close()


class LeaderRunner:
    """Rank 0's model runner: ``ModelRunner`` whose ``launch`` and ``apply_swaps`` first
    send the step to the other ranks; everything else is the runner's own."""

    def __init__(self, runner: ModelRunner, sender: StepSender) -> None:
        self._runner, self.sender = runner, sender

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def apply_swaps(self, decision: ScheduleDecision) -> None:
        self.sender.send(self.sender.step(decision, swaps=True))
        self._runner.apply_swaps(decision)

    def launch(self, decision: ScheduleDecision) -> PendingStep:
        self.sender.send(self.sender.step(decision, swaps=False))
        return self._runner.launch(decision)

    def execute(self, decision: ScheduleDecision) -> list:
        return self.launch(decision).collect()


class TPMirror:
    """A rank > 0's copies of rank 0's requests (``Req`` objects with what the forward
    pass reads: prompt, known outputs, pages, tokens in flight) and the steps it runs."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.reqs: dict[str, Req] = {}

    def run(self, msg: m.TPStep) -> None:
        for rid in msg.done:
            self.reqs.pop(rid, None)
        for new in msg.new_reqs:
            self.reqs[new.rid] = Req(new.rid, list(new.prompt_ids), m.SamplingParams(),
                                     return_logprob=new.return_logprob, logprob_start_len=new.logprob_start_len)
        if msg.swap_out or msg.swap_in:
            self.runner.apply_swaps(ScheduleDecision(
                swap_out=[(self.reqs[rid], pages) for rid, pages in msg.swap_out],
                swap_in=[SwapIn(self.reqs[rid], pages, first) for rid, pages, first in msg.swap_in]))
        if msg.items:
            self.runner.follow(ScheduleDecision(items=[self._item(it) for it in msg.items],
                                                decode_steps=msg.decode_steps))

    def _item(self, it: m.TPItem) -> ScheduleItem:
        req = self.reqs[it.rid]
        req.output_ids.extend(it.new_output_ids)
        req.num_inflight, req.pages = it.num_inflight, it.pages
        if req.wants_prompt_logprobs and len(req.prompt_logprobs) != it.num_prompt_logprobs:
            req.prompt_logprobs = [None] * it.num_prompt_logprobs  # only its length is read
        return ScheduleItem(req, it.start, it.num_tokens, it.samples)


def run_tp_worker_process(args: ServerArgs, placement: RankPlacement, parent_pid: int) -> None:
    """Entry point of a tensor parallel rank > 0: build its runner (joining the process
    group), then run rank 0's steps until the parent is gone. Any error ends the process
    with status 1 (the launcher then stops the server: the ranks' collectives cannot
    continue without it)."""
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s tp-rank-{placement.tp_rank} %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher owns shutdown
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        runner = ModelRunner(args, placement)
        steps = MsgSocket(zmq.PULL, placement.step_addrs[0], bind=False)
        mirror = TPMirror(runner)
        while os.getppid() == parent_pid:
            msg = steps.recv(timeout_ms=100)
            if msg is not None:
                mirror.run(msg)
    except Exception:
        logger.exception("tensor parallel rank %d failed", placement.tp_rank)
        os._exit(1)
    logger.error("parent process is gone; exiting")
    os._exit(0)
