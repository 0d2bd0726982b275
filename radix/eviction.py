"""Eviction policies for the radix tree, selected by name.

A policy is a plain function ``node -> sort key``: the tree evicts the candidate leaf
(an unlocked node without children) with the *lowest* key first. Keys must be mutually
comparable (numbers or tuples of numbers). The registry ``EVICTION_POLICIES`` feeds the
CLI ``choices`` (``--radix-eviction-policy``); adding a policy is one function plus one
registry line. ``CandidateHeap`` is the tree's lazily invalidated min-heap over those keys.
A *learned* policy is registered as a class instead: ``get_policy`` builds one instance
per tree, and the heap feeds it events (``observe_new_candidate``, ``observe_evicted``)
and calls its ``refresh`` now and then (see ``CandidateHeap``).

Policies (``radixlm bench cache-sim`` compares them with Belady's offline optimum; the
figures are in BENCHMARKS.md "Eviction policies vs Belady"):

* ``lru``: least recently used first.
* ``lfu``: fewest prefix matches first, then least recently used.
* ``longest``: largest leaf (most pages, i.e. frees the most) first, then LRU.
* ``importance``: a weighted score in seconds, lowest first; see ``importance``.
* ``continuation-odds``: recency plus the log-odds, learned online, that a cached
  sequence of its length is used again; see ``ContinuationOdds``.
* ``reuse-gap``: expected hits per page and second from the time between a
  conversation's turns (``reuse_gap``); see ``ReuseGap``.
* ``liveness``: ``reuse-gap``'s hit density with the odds that a sequence is used again
  predicted by a logistic model (new pages, turn, length, conversation age); see
  ``Liveness``.

Contract a policy must keep (the tree's heap relies on it):

* Pure: the key depends only on the node's fields, never on global state (no clock
  read, no tree-wide statistics), so a key computed when the node was pushed is still
  its key later unless the node itself changed.
* Monotone: while a node stays a candidate leaf, its key may only *grow*. The node
  fields change only this way: ``last_access`` and ``hit_count`` grow (match/insert
  touch it), ``num_pages`` shrinks (a split moves the node's first pages into a new
  parent), ``prefix_len`` never changes (a split keeps where the node ends). So a key
  may increase with ``last_access``, ``hit_count`` and decrease with ``num_pages``;
  it may use ``prefix_len`` either way. The tree keeps a lazy min-heap: an entry whose
  key went stale is noticed when it reaches the top, re-keyed and pushed back. A key
  that *shrinks* behind the tree's back is only noticed when it reaches the top, so
  that node would be evicted later than its true key says; a policy whose key a match
  may lower says ``rekey_on_match`` and the tree pushes the matched leaf again.
* A learned policy's keys may change only inside ``refresh`` (its model snapshot),
  after which the heap re-keys every entry; between refreshes both rules above hold.
  (``reuse_gap`` changes only with a match, which also touches ``last_access``.)
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar


class NodeStats(Protocol):
    """The node fields a policy may read (``radix.tree.TreeNode`` provides them)."""

    last_access: float  # clock value of the last match/insert that touched the node
    hit_count: int  # number of match_prefix calls that matched into the node
    prefix_len: int  # tokens from the root to the end of the node's key
    reuse_gap: float  # clock seconds between its last two uses; inf: not known (tree._touch)

    @property
    def num_pages(self) -> int: ...


class HeapNode(NodeStats, Protocol):
    heap_seq: int  # sequence number of the node's newest heap entry, set by CandidateHeap


EvictionPolicy = Callable[[NodeStats], Any]
N = TypeVar("N", bound=HeapNode)


def lru(node: NodeStats) -> float:
    """Least recently used first."""
    return node.last_access


def lfu(node: NodeStats) -> tuple[int, float]:
    """Least frequently used first; ties broken by least recently used."""
    return (node.hit_count, node.last_access)


def longest(node: NodeStats) -> tuple[int, float]:
    """Largest leaf (most pages) first; ties broken by least recently used.

    MISSION.md section 4's "longest first: evict the largest sequences (frees most)",
    applied to cached leaves: one eviction frees a whole leaf, so this frees the most
    pages per evicted leaf. Monotone: a split only shrinks ``num_pages``.
    """
    return (-node.num_pages, node.last_access)


IMPORTANCE_REUSE_S = 10.0  # w3: seconds of extra life per doubling of (1 + hit_count)
IMPORTANCE_MEMORY_S = 10.0  # w2: seconds less per doubling of the sequence's length


def importance(node: NodeStats) -> float:
    """MISSION.md section 4's ``w1 * recency + w2 * memory_usage + w3 * reuse`` for an
    unlocked cached leaf, lowest first. Every term is in seconds (w1 = 1):

        key = last_access                                  recency: the clock, seconds
              - IMPORTANCE_MEMORY_S * log2(prefix_len)     memory: the KV the sequence
                                                           ending here holds, in tokens
              + IMPORTANCE_REUSE_S * log2(1 + hit_count)   expected reuse: past matches

    Normalisation: the memory and reuse terms are log2 ratios (doubling the sequence or
    the hit count moves the key by a fixed number of seconds), so they are unit-free and
    do not depend on the page size; the weights convert one doubling into seconds of
    recency, the scale of the time between two uses of a cached prefix (a chat user's
    think time). Recency is the node's last access on the tree's clock, not an age
    ``now - last_access``: the order is the same and the key needs no global clock.
    Monotone (see the module docstring): it grows with ``last_access`` and
    ``hit_count``; ``prefix_len`` is fixed while the node is a leaf.
    Weights: chosen with ``radixlm bench cache-sim``
    (BENCHMARKS.md "Eviction policies vs Belady").
    """
    return (
        node.last_access
        - IMPORTANCE_MEMORY_S * math.log2(node.prefix_len)
        + IMPORTANCE_REUSE_S * math.log2(1 + node.hit_count)
    )


CONTINUATION_BUCKET_TOKENS = 512  # sequence-length class width of the learned odds
CONTINUATION_MAX_BUCKET = 63  # longer sequences share the last class (32K+ tokens)
CONTINUATION_THINK_S = 60.0  # tau: mean time between two turns of a conversation
CONTINUATION_PRIOR_WEIGHT = 100.0  # pseudo-trials pulling each class to the pooled rate
CONTINUATION_AGE_BINS = 16  # histogram of idle ages at eviction, bins of tau / 2


class ContinuationOdds:
    """Recency plus the learned log-odds that a cached sequence is used again, lowest
    first (a posterior-odds / hazard policy, learned online from the tree's own events).

    Model (a conversation as a stream of turns): after a sequence of length L was
    cached, it is matched again (the conversation's next turn) with probability p(L),
    after an exponential think time of mean tau. A leaf idle for t seconds is then still
    "alive" with posterior odds ``p / (1 - p) * exp(-t / tau)``; an alive leaf is reused
    at rate 1 / tau whatever its size, so ranking leaves by those odds ranks them by
    expected hits per page and second (LHD's hit density, Beckmann et al., NSDI 2018,
    in closed form for exponential think times). In log-odds that is

        key = last_access + tau * logit(p(L))          seconds, lowest first

    which does not depend on the clock, so the heap needs no re-keying as time passes.

    p(L), per 512-token class of ``prefix_len``, is the censored maximum-likelihood
    estimate from the tree's own events: a new leaf (``hit_count == 0``) is a trial;
    it succeeds when a later sequence extends it (the next new leaf's parent has
    ``hit_count == 1``: matched once, by that sequence); it is censored at age a when
    evicted unused, with likelihood ``1 - p + p * exp(-a / tau)`` (it may still have
    come back). Leaves still cached are not counted yet. Ages are binned by tau / 2; EM
    over the bins gives p, shrunk to the pooled estimate with
    ``CONTINUATION_PRIOR_WEIGHT`` pseudo-trials. "Now" is the newest ``last_access`` seen.
    Approximate on the server, which caches a request twice (its prompt after prefill,
    then prompt + output): a conversation that ends is censored at both nodes' classes.
    tau is a constant, this simulator trace's mean think time; it is not learned.

    Keys use a snapshot of the estimates, updated by ``refresh`` when ``CandidateHeap``
    re-keys all its entries (after as many new leaves as it has entries: O(1)
    amortised per push); between refreshes the key is pure and monotone like every
    other policy's (``prefix_len`` is fixed for a leaf). One object per tree:
    ``get_policy`` builds a new one each call.
    """

    def __init__(self, think_s: float = CONTINUATION_THINK_S) -> None:
        classes = CONTINUATION_MAX_BUCKET + 1
        self.think_s = think_s
        self.now = -math.inf
        self.continued = [0] * classes
        self.censored = [[0] * CONTINUATION_AGE_BINS for _ in range(classes)]
        self.log_odds = [0.0] * classes  # the snapshot keys use

    @staticmethod
    def bucket(prefix_len: int) -> int:
        return min(prefix_len // CONTINUATION_BUCKET_TOKENS, CONTINUATION_MAX_BUCKET)

    def __call__(self, node: NodeStats) -> float:
        return node.last_access + self.think_s * self.log_odds[self.bucket(node.prefix_len)]

    def observe_new_candidate(self, node: Any) -> None:
        """A node becomes an eviction candidate for the first time (a new leaf)."""
        self.now = max(self.now, node.last_access)
        parent = node.parent
        if parent is not None and parent.parent is not None and parent.hit_count == 1:
            self.continued[self.bucket(parent.prefix_len)] += 1

    def observe_evicted(self, node: Any) -> None:
        """A leaf is evicted; an unused one is a censored trial."""
        if node.hit_count == 0:
            age = max(self.now - node.last_access, 0.0)
            b = min(int(2 * age / self.think_s), CONTINUATION_AGE_BINS - 1)
            self.censored[self.bucket(node.prefix_len)][b] += 1

    def _mle(self, continued: float, censored: list[float], prior: float, weight: float) -> float:
        """EM for p with ``continued`` successes and censored trials per age bin."""
        stay = [math.exp(-(b + 0.5) / 2) for b in range(CONTINUATION_AGE_BINS)]
        n = continued + sum(censored) + weight
        p = prior
        for _ in range(50):
            alive = sum(c * p * s / (1 - p + p * s) for c, s in zip(censored, stay, strict=True))
            p = (continued + alive + weight * prior) / n
        return p

    def refresh(self) -> None:
        """Recompute the per-class log-odds snapshot from the counts."""
        pooled_censored = [sum(col) for col in zip(*self.censored, strict=True)]
        pooled = self._mle(sum(self.continued), pooled_censored, 0.5, 2.0)
        for b, (k, cens) in enumerate(zip(self.continued, self.censored, strict=True)):
            p = self._mle(k, cens, pooled, CONTINUATION_PRIOR_WEIGHT)
            p = min(max(p, 1e-3), 1 - 1e-3)
            self.log_odds[b] = math.log(p / (1 - p))


# Fitted on the first half hour of the Mooncake trace (bench/cache/fit_eviction.py):
REUSE_GAP_SCALE = 1.0  # a: the next gap's mean is a x the last gap + b
REUSE_GAP_OFFSET_S = 90.0  # b, seconds
REUSE_GAP_UNKNOWN_S = 150.0  # the mean gap after a first turn (no gap known yet), seconds
REUSE_GAP_FIRST_LOG_ODDS = -3.0  # logit P(a first turn continues) - logit P(a later turn does)
REUSE_GAP_REFRESH_S = 10.0  # the clock snapshot the keys use is at most this old


class ReuseGap:
    """Lowest expected hits per page and second first, from the pace of a conversation.

    A cached sequence is the prefix of a conversation's next turn with probability p, after
    a gap (from its last use to that turn's arrival) of mean mu, taken exponential. After
    t idle seconds the posterior odds that it is still coming back are
    ``p / (1 - p) * exp(-t / mu)``, and one that comes back does so at rate 1 / mu; the
    expected hits per cached page and second are then about
    ``p / (1 - p) * exp(-t / mu) / mu`` (LHD's hit density, Beckmann et al., NSDI 2018),
    whatever the sequence's length: each of its pages is one hit. In logs:

        key = log_odds - t / mu - log(mu)      lowest first; t = now - last_access (s)

    The prefix's pace is its ``reuse_gap`` (set by the tree, ``RadixTree._touch``: the time
    between a turn's end and the next turn's arrival, as LIRS ranks blocks by their
    inter-reference recency, Jiang and Zhang, SIGMETRICS 2002): the next gap is about the
    last one, ``mu = REUSE_GAP_SCALE * reuse_gap + REUSE_GAP_OFFSET_S``. A sequence with no
    known gap (a conversation's first turn) has ``mu = REUSE_GAP_UNKNOWN_S`` and log-odds
    ``REUSE_GAP_FIRST_LOG_ODDS`` relative to a later turn's (0). The constants were fitted
    on the first half hour of the Mooncake trace (bench/cache/fit_eviction.py, BENCHMARKS.md
    "Eviction policies vs Belady"); with them a first turn ranks below any sequence whose
    gap is under ~48 minutes (``e^(3 + ln 150) - 90`` s) at the same idle time and decays
    faster, so first turns go first, least recently used first, and the others follow by
    hit density. A gap is known once a conversation's second turn arrives, even if its
    first was evicted meanwhile: the tree remembers the last use of removed prefixes
    (``uses_ghosts``; radix/tree.py "Ghosts", as ARC and LIRS keep ghost entries).

    Unlike the other policies the order of two sequences changes with time (each decays at
    its own rate 1 / mu), so keys use a snapshot of the clock, ``now``: the newest
    ``last_access`` seen, taken at most ``REUSE_GAP_REFRESH_S`` seconds of clock apart
    (``refresh_due``), when ``CandidateHeap`` re-keys all its entries. Between refreshes the
    key is pure and grows with ``last_access``; a match may also lower it (a longer
    ``reuse_gap`` lowers the hit density), so the tree pushes a matched candidate leaf
    again (``rekey_on_match``). One object per tree: ``get_policy`` builds a new one.
    """

    uses_ghosts = True  # the tree remembers removed prefixes' last uses (tree "Ghosts")
    rekey_on_match = True  # a match can lower a candidate's key: the tree pushes it again

    def __init__(
        self,
        scale: float = REUSE_GAP_SCALE,
        offset_s: float = REUSE_GAP_OFFSET_S,
        unknown_s: float = REUSE_GAP_UNKNOWN_S,
        first_log_odds: float = REUSE_GAP_FIRST_LOG_ODDS,
    ) -> None:
        self.scale, self.offset_s = scale, offset_s
        self.unknown_s, self.first_log_odds = unknown_s, first_log_odds
        self.now = 0.0  # the snapshot the keys use
        self.latest = 0.0  # the newest last_access seen

    def __call__(self, node: NodeStats) -> float:
        gap = node.reuse_gap
        if gap == math.inf:
            mu, log_odds = self.unknown_s, self.first_log_odds
        else:
            mu, log_odds = max(self.scale * gap + self.offset_s, 1.0), 0.0
        idle = max(self.now - node.last_access, 0.0)
        return log_odds - idle / mu - math.log(mu)

    def observe_new_candidate(self, node: Any) -> None:
        self.latest = max(self.latest, node.last_access)

    def refresh_due(self) -> bool:
        return self.latest - self.now >= REUSE_GAP_REFRESH_S

    def refresh(self) -> None:
        self.now = self.latest


# Fitted on the first half hour of the Mooncake trace (bench/cache/fit_eviction.py, "liveness"):
# logit P(the sequence is used again within 5 min) = bias + sum(weight x feature), features
# as ``Liveness.features`` computes them (log2 each).
LIVENESS_WEIGHTS = (-0.364, 0.907, 0.102, -0.179)  # new pages, turn, prefix pages, conversation age (s)
LIVENESS_BIAS = -0.201  # does not change the order (every key has it); kept for the probability
LIVENESS_RECORDS = 1 << 16  # sequence ends remembered (turn, conversation start), oldest forgotten


class Liveness(ReuseGap):
    """``ReuseGap``'s hit density with the odds that the sequence is used again predicted,
    per cached sequence, by a logistic model of what was known when it was cached.

        key = z - t / mu - log(mu)      lowest first; t = now - last_access (s), mu as ReuseGap

    where z = ``LIVENESS_BIAS + LIVENESS_WEIGHTS . features`` is the predicted log-odds
    that the sequence is used again (a first turn is no longer a fixed -3: its own z).
    ``features`` of a node, computed once, when it first becomes an eviction candidate
    (a new leaf), all log2 and in the tree's pages:

    * new pages: pages past the end of the deepest sequence seen before that this one
      extends (the conversation's previous turn, cached or already evicted), or all of
      its pages when it extends none: a short follow-up is more likely to be followed;
    * turn: 1 + the turn of that earlier sequence (1 when none);
    * prefix pages: the sequence's whole length;
    * conversation age: 1 + seconds since that conversation's first turn.

    The sequences seen (new leaves never matched yet) are remembered by their end
    (``prefix_len``, last page's token ids, as the tree's ghosts) with their turn, their
    conversation's start and where their new part began, the newest ``LIVENESS_RECORDS``.
    The earlier sequence is the deepest remembered end inside the node's key, else its
    parent's, unless the parent is shared (matched more than once: a system prompt, as
    for ``reuse_gap``); a new leaf under a parent never matched (the server's second
    insert of a request: prompt, then prompt + output) continues the parent's turn.

    The per-node log-odds is fixed when computed, so the key changes as ``ReuseGap``'s
    does: with the clock snapshot (``refresh``) and when the node is used. It is kept in
    a dict keyed by the node (nodes hash by identity), pruned of detached nodes at each
    refresh. The weights come from ``bench/cache/fit_eviction.py`` (BENCHMARKS.md
    "Eviction policies vs Belady"); the bias shifts every key alike. One object per
    tree: ``get_policy`` builds a new one.
    """

    def __init__(
        self,
        weights: Iterable[float] = LIVENESS_WEIGHTS,
        bias: float = LIVENESS_BIAS,
        **reuse_gap: float,
    ) -> None:
        super().__init__(**{"first_log_odds": 0.0, **reuse_gap})
        self.weights, self.bias = tuple(weights), bias
        self._log_odds: dict[Any, float] = {}  # node -> z
        # (end, last page's ids packed) -> (turn, conversation start, end of the earlier sequence)
        self._records: OrderedDict[tuple[int, bytes], tuple[int, float, int]] = OrderedDict()

    def log_odds(self, node: Any) -> float:
        """The node's predicted log-odds (``bias`` for a node never seen as a candidate)."""
        return self._log_odds.get(node, self.bias)

    def __call__(self, node: NodeStats) -> float:
        gap = node.reuse_gap
        mu = self.unknown_s if gap == math.inf else max(self.scale * gap + self.offset_s, 1.0)
        idle = max(self.now - node.last_access, 0.0)
        return self.log_odds(node) - idle / mu - math.log(mu)

    def _earlier(self, node: Any, page_bytes: int) -> tuple[int, tuple[int, float, int]] | None:
        """(end, record) of the deepest remembered sequence this node extends, or None."""
        packed, start = node.packed, node.prefix_len - node.num_tokens
        token_bytes = len(packed) // node.num_tokens  # radix.tree.TOKEN_BYTES
        for end in range(len(packed), 0, -page_bytes):
            rec = self._records.get((start + end // token_bytes, packed[end - page_bytes : end]))
            if rec is not None:
                return start + end // token_bytes, rec
        parent = node.parent
        if parent is not None and parent.parent is not None and parent.hit_count <= 1:
            rec = self._records.get((parent.prefix_len, parent.packed[-page_bytes:]))
            if rec is not None:
                return parent.prefix_len, rec
        return None

    def features(self, node: Any) -> tuple[float, float, float, float]:
        """Remember the node's sequence and return its features (class docstring)."""
        now = node.last_access
        page_tokens, page_bytes = node.num_tokens // node.num_pages, len(node.packed) // node.num_pages
        found = self._earlier(node, page_bytes)
        if found is None:
            turn, start, base = 1, now, node.prefix_len - node.num_tokens
        else:
            end, (turn, start, base) = found
            if end != node.parent.prefix_len or node.parent.hit_count:  # else: same request
                turn, base = turn + 1, end
        if node.hit_count == 0:  # a new sequence (not a split-off prefix left childless)
            key = (node.prefix_len, node.packed[-page_bytes:])
            self._records[key] = (turn, start, base)
            self._records.move_to_end(key)
            if len(self._records) > LIVENESS_RECORDS:
                self._records.popitem(last=False)
        return (
            math.log2(1 + (node.prefix_len - base) // page_tokens),
            math.log2(turn),
            math.log2(node.prefix_len // page_tokens),
            math.log2(1 + max(now - start, 0.0)),
        )

    def observe_new_candidate(self, node: Any) -> None:
        super().observe_new_candidate(node)
        if node not in self._log_odds:
            f = self.features(node)
            self._log_odds[node] = self.bias + sum(w * x for w, x in zip(self.weights, f, strict=True))

    def refresh(self) -> None:
        super().refresh()
        self._log_odds = {n: z for n, z in self._log_odds.items() if n.parent is not None}


EVICTION_POLICIES: dict[str, EvictionPolicy] = {
    "lru": lru,
    "lfu": lfu,
    "longest": longest,
    "importance": importance,
    "continuation-odds": ContinuationOdds,
    "reuse-gap": ReuseGap,
    "liveness": Liveness,
}


def get_policy(name: str) -> EvictionPolicy:
    """Look a policy up by name; ValueError lists the valid names. A learned policy
    (registered as a class) gets a fresh instance per call."""
    try:
        policy = EVICTION_POLICIES[name]
    except KeyError:
        choices = ", ".join(sorted(EVICTION_POLICIES))
        raise ValueError(f"unknown eviction policy {name!r}; choose from: {choices}") from None
    return policy() if isinstance(policy, type) else policy


REFRESH_MIN_NEW = 64  # a learned policy refreshes after at least this many new leaves


class CandidateHeap:
    """Min-heap of eviction candidates ordered by a policy, with lazy invalidation.

    Entries are ``(policy key, seq, node)``; ``seq`` is unique, so nodes are never
    compared. Pushing a node again supersedes its older entries (``node.heap_seq``).
    ``pop`` skips superseded entries and entries the owner no longer considers valid,
    and re-pushes an entry whose key grew since it was pushed (policies are monotone).

    A learned policy (one with ``observe_new_candidate``) hears of every node pushed for
    the first time (``heap_seq < 0``: a new leaf, or a split-off parent whose children
    all went) and of every node ``pop`` returns (it is evicted). After as many such new
    nodes as the heap had entries at the last refresh (at least ``REFRESH_MIN_NEW``),
    or sooner when the policy's ``refresh_due()`` says so (a clock snapshot grown old),
    the heap calls ``policy.refresh()`` and re-keys its live entries: O(n) every >= n
    pushes, so O(1) amortised per push and eviction stays O(log n) amortised; a
    ``refresh_due`` policy adds O(n) per its refresh period.
    """

    def __init__(self, policy: EvictionPolicy) -> None:
        self._policy = policy
        self._entries: list[tuple[Any, int, Any]] = []
        self._seq = itertools.count()
        self._observe = getattr(policy, "observe_new_candidate", None)
        self._observe_evicted = getattr(policy, "observe_evicted", None)
        self._refresh_due = getattr(policy, "refresh_due", None)
        self._new_since_refresh = 0
        self._refresh_after = REFRESH_MIN_NEW  # new leaves; at least the entries re-keyed

    def __len__(self) -> int:
        return len(self._entries)

    def push(self, node: HeapNode) -> None:
        if self._observe is not None and node.heap_seq < 0:
            self._observe(node)
            self._new_since_refresh += 1
            due = self._refresh_due is not None and self._refresh_due()
            if due or self._new_since_refresh >= self._refresh_after:
                self._refresh()
        node.heap_seq = next(self._seq)
        heapq.heappush(self._entries, (self._policy(node), node.heap_seq, node))

    def _refresh(self) -> None:
        """Let a learned policy update its estimates, then re-key every live entry."""
        self._new_since_refresh = 0
        self._policy.refresh()
        live = [(node, seq) for _key, seq, node in self._entries if seq == node.heap_seq]
        self._entries = [(self._policy(node), seq, node) for node, seq in live]
        heapq.heapify(self._entries)
        self._refresh_after = max(REFRESH_MIN_NEW, len(self._entries))

    def pop(self, is_valid: Callable[[N], bool]) -> N | None:
        """Remove and return the valid node with the lowest current key, or None."""
        while self._entries:
            key, seq, node = heapq.heappop(self._entries)
            if seq != node.heap_seq or not is_valid(node):
                continue
            current = self._policy(node)
            if current != key:  # touched since it was pushed: re-key and retry
                heapq.heappush(self._entries, (current, seq, node))
                continue
            if self._observe_evicted is not None:
                self._observe_evicted(node)
            return node
        return None

    def rebuild(self, nodes: Iterable[HeapNode]) -> None:
        """Replace all entries by one fresh entry per node in ``nodes``. O(len(nodes))."""
        self._entries = []
        for node in nodes:
            node.heap_seq = next(self._seq)
            self._entries.append((self._policy(node), node.heap_seq, node))
        heapq.heapify(self._entries)

    def live_ids(self) -> set[int]:
        """``id()`` of every node whose newest entry is present (for invariant checks)."""
        return {id(node) for _key, seq, node in self._entries if seq == node.heap_seq}
