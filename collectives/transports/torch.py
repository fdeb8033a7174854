"""The ``torch`` transport: torch.distributed point-to-point messages, for ranks on several hosts (any gloo layout).

``local`` exists but no peer is addressable, so the one-sided primitives are absent (``direct`` is
False). Each buffer has a gloo process group of its own, made over the buffer's rendezvous prefix in
the job's store: the messages of another buffer (a retired one, whose rank was stopped and resumed)
travel in another group and can never pair with this buffer's. An exchange is one message per peer,
a 24-byte header (buffer id, exchange number, payload bytes) and the payload, sent and received point
to point with the buffer's timeout: a peer that does not send within it is named, and a header that is
not this exchange's (another buffer, another exchange, another size) is an error naming its sender,
never data. A payload of at most :data:`INLINE_BYTES` travels in its header's message (the agreements:
one message per peer instead of two, and no second wait); a larger one follows its header, and its
receive is posted only once the header is checked, because gloo ends the process (``terminate``) when
a message is longer than the receive posted for it (seen with torch 2.13's gloo). The header's receive
is always posted with room for a header and an inline payload, which no sender exceeds (an exchange whose sizes
every rank agreed on before may post its payloads' receives at once, to overlap work with their transfer:
``all_to_all``'s ``meanwhile``). A payload may travel in two parts, the first received straight into memory of the
receiver's choosing (``split`` / ``into``; the header then has a fourth word, where the parts meet, which the
receiver checks against where it expects them to). Since the size
travels in the header, a receiver may also take a message whose size it only bounds (``exact=False``:
a low-latency message, whose own header says how many rows follow), so that only the bytes a sender
filled cross the network, not its whole region.

``bytes_sent[r]`` counts the bytes this rank has sent rank ``r`` (headers and payloads; 0 for itself, whose
message is a local copy): what crosses the network, for tests and benchmarks of what a protocol moves.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from epkit.collectives.bootstrap import bounded_call
from epkit.collectives.deadline import deadline_after
from epkit.collectives.transports.base import Transport

__all__ = ["INLINE_BYTES", "SPLIT_HEAD", "TorchTransport"]

_HEADER_WORDS = 3  # buffer id, exchange number, payload bytes
_HEAD = 8 * _HEADER_WORDS
#: Header bytes of a payload sent in two parts (``all_to_all``'s ``split``): a fourth word, where they meet.
SPLIT_HEAD = _HEAD + 8
_SPLIT = 1 << 62  # in the size word: the header has the fourth word
#: Payloads up to this many bytes travel inside their header's message (see the module docstring).
INLINE_BYTES = 16384
_TAGS = 1 << 20
# Groups and tensors of buffers retired with requests still posted: gloo may still write into a receive
# posted before a timeout, so its memory (and the group) must never be freed. Kept for the process's life.
_RETIRED: list = []


#: Seconds a rank that gives up waits for the job store to take why (:meth:`TorchTransport.tell`; it goes on in
#: the background after that).
_TELL_S = 0.2
#: Seconds at most that a failed wait listens for its peer's notice when the peer said it is itself giving its own
#: peer a grace (:meth:`TorchTransport.waiting`): the longest grace and a store round trip, within the 1.5 s
#: past the timeout that a failed wait may take.
CHAIN_GRACE_S = 1.4


class _Refused:
    """A send or receive gloo refused when it was posted (the connection to the peer already gone): its wait raises
    that error."""

    def __init__(self, exc: RuntimeError) -> None:
        self.exc = exc

    def wait(self, *args: object) -> None:
        raise self.exc


def _told(me: str, peer: str, what: str, src: int, heard: tuple[int, bool]) -> TimeoutError:
    """The error for a wait on ``peer`` (position ``src``) that failed after the peer said why it gave up."""
    from epkit.collectives.peer_failure import PeerFailedError

    culprit, silent = heard
    if silent:
        msg = (
            f"{me}: {what} abandoned: {peer} reports that rank {culprit} sent no signal within its timeout "
            f"(it died or stopped calling)"
        )
    else:
        msg = f"{me}: {what} abandoned: rank {culprit} gave up on this buffer after a failure on its side"
    exc = PeerFailedError(msg, src, silent)
    exc.culprit = heard  # passed on by the exchange that retires the buffer
    return exc


def _inline(nbytes: int, split: int) -> bool:
    """Whether a payload travels inside its header's message (small and in one part), on both sides' word."""
    return not split and nbytes <= INLINE_BYTES


class TorchTransport(Transport):
    """Host memory for ``local`` plus a gloo group of the buffer's own (see the module docstring)."""

    name = "torch"

    def __init__(self, rv, hello: list[dict], num_bytes: int, num_signals: int):
        super().__init__(rv, hello, num_bytes, num_signals)
        # local, the staging of one message per peer and the receive space, each kept between exchanges
        self.check_memory(hello, 3 * num_bytes, "the local buffer, the per-peer staging and the receive space")
        self.buffer_id = rv.buffer_id
        self._exchanges = 0
        self._rv = rv  # its job store is where a rank that gives up says why (tell), for the peers whose waits fail
        self._store_lost = False  # a store call did not come back (a host cut off): none is made again
        # One deadline for the group: every rank must reach it (a rank that does not is named), and the group's
        # rendezvous waits on the job store end by it too, not after the store's own timeout.
        deadline = deadline_after(rv.timeout)
        rv.gather("torch/group", None, deadline=deadline)
        try:
            store = dist.PrefixStore("pg/", rv.store)
            with rv.store_deadline(deadline):
                self.pg = dist.ProcessGroupGloo(store, self.rank, self.world_size, timedelta(seconds=rv.timeout))
        except RuntimeError as exc:
            cause = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            why = rv.abandoned()  # a rank that gave up on the buffer after the hello says why
            # Who never reports failing as well: every live rank's group fails by the deadline (gloo's rendezvous
            # ends within its timeout + about 1 s), so the ranks without a report by then died or stopped.
            lost = [] if why else rv.missing("torch/group-failed", max(deadline + 1.2, time.monotonic() + 0.2))
            if lost:
                why = f"{rv.names(lost)} died or stopped while it was made; here: {cause}"
            why = why or cause
            raise TimeoutError(
                f"{rv.names([self.rank])}: the torch transport's own gloo group could not be made within "
                f"{rv.timeout:g} s ({why})"
            ) from None
        self.local = torch.zeros(num_bytes, dtype=torch.uint8)
        #: Bytes sent to each rank of the group so far (headers and payloads; see the module docstring).
        self.bytes_sent = [0] * self.world_size
        self._recv = torch.empty(0, dtype=torch.uint8)
        self._heads = None  # [world, header + INLINE_BYTES] uint8: each peer's header message, kept
        self._closed = False

    def _notice_key(self, rank: int) -> str:
        return f"epkit-notice/{self.buffer_id:x}/{rank}"

    def tell(self, culprit: int, silent: bool) -> None:
        if self._store_lost:
            return
        store, key = self._rv.store, self._notice_key(self.rank)
        finished, _ = bounded_call(lambda: store.set(key, f"{culprit} {int(silent)}"), _TELL_S)  # best effort
        self._store_lost = not finished

    def waiting(self, grace: float) -> None:
        """Say (best effort) that this rank's wait failed and that it gives its own peer ``grace`` seconds before
        telling whom it names: a rank waiting on this one then waits that long too (a chain of two ranks that
        cannot see each other's processes would otherwise end both graces at once, and the first would name the
        second, which is live)."""
        if self._store_lost or grace <= 0:
            return
        store, key = self._rv.store, self._notice_key(self.rank)
        finished, _ = bounded_call(lambda: store.set(key, f"waiting {grace:.3f}"), _TELL_S)
        self._store_lost = not finished

    def _heard(self, src: int, grace: float) -> tuple[int, bool] | None:
        """``(culprit, silent)`` that rank ``src`` told (:meth:`tell`) within ``grace`` seconds (longer by the grace
        ``src`` said it gives its own peer, :meth:`waiting`, at most :data:`CHAIN_GRACE_S` in all), or None (also
        when the job store is out of reach)."""
        store, key, start = self._rv.store, self._notice_key(src), time.monotonic()
        end = [start + grace]

        def poll() -> tuple[int, bool] | None:
            while True:  # at least once: a peer that told and then exited closed its connection
                if store.check([key]):
                    word, value = store.get(key).decode().split()
                    if word != "waiting":
                        return int(word), value == "1"
                    end[0] = max(end[0], min(time.monotonic() + float(value) + _TELL_S, start + CHAIN_GRACE_S))
                if time.monotonic() >= end[0]:
                    return None
                time.sleep(0.02)

        if self._store_lost:
            return None
        finished, heard = bounded_call(poll, CHAIN_GRACE_S + _TELL_S)
        self._store_lost = not finished
        return heard

    def _wait(self, work, deadline: float, timeout: float, src: int, what: str) -> None:
        left = max(deadline - time.monotonic(), 1e-3)
        try:
            work.wait(timedelta(seconds=left))
        except RuntimeError as exc:  # gloo: a timeout, or the connection to a peer that died or gave up
            raise self._peer_failed(exc, timeout, src, what) from None

    def _post_payload(self, src: int, first: int, into, view: torch.Tensor, tag: int) -> list:
        """Post the receives of ``src``'s payload: none when it travels in its header's message, else one part into
        ``view`` (tag + 1), or ``first`` bytes into ``into`` and the rest into ``view`` (tags + 1, + 2)."""
        if first:
            parts = [(p, tag + 1 + i) for i, p in enumerate((into, view)) if p.numel()]
        else:
            parts = [] if _inline(view.numel(), 0) else [(view, tag + 1)]
        return [self._post(self.pg.recv, p.view(-1), src, t) for p, t in parts]

    def _post_heads(self, heads: torch.Tensor, tag: int) -> dict:
        """Post the receive of every peer's header message (``tag``) into its row of ``heads``: ``{src: work}``."""
        w, me = self.world_size, self.rank
        return {src: self._post(self.pg.recv, heads[src], src, tag) for src in range(w) if src != me}

    @staticmethod
    def _post(op, t: torch.Tensor, peer: int, tag: int):
        """``op([t], peer, tag)`` (the group's ``send`` or ``recv``). Gloo raises at once when the connection to
        ``peer`` is already gone: the request returned then raises that error at its wait, so that it is judged in
        the exchange's order, as a failed wait is (:meth:`_wait`)."""
        try:
            return op([t], peer, tag)
        except RuntimeError as exc:
            return _Refused(exc)

    def _peer_failed(self, exc: RuntimeError, timeout: float, src: int, what: str) -> Exception:
        """The error for gloo's ``exc`` on a message of ``src``: what ``src`` told, when it gave up (closing its
        group) and says why, within its grace; otherwise its silence."""
        cause = "timed out" if "Timed out" in str(exc) else str(exc).strip().splitlines()[0][:200]
        me, peer = self.rank_name(self.rank), self.rank_name(src)
        grace = self.grace(src)
        self.waiting(grace)
        heard = self._heard(src, grace)
        # a peer that says it was itself the silent one (it was stopped, resumed, and learnt so from another rank)
        # tells nothing new: it is the silent peer
        if heard is not None and heard != (self.global_ranks[src], True):
            return _told(me, peer, what, src, heard)
        silence = TimeoutError(
            f"{me}: {peer} sent no {what} message within {timeout:g} s ({cause}); it died or stopped calling"
        )
        silence.peer = src  # type: ignore[attr-defined]  # a position, as silence_error's
        silence.culprit = (self.global_ranks[src], True)  # type: ignore[attr-defined]  # whom to name
        return silence

    def barrier(self, timeout: float) -> None:
        self.all_to_all(
            [torch.empty(0, dtype=torch.uint8)] * self.world_size, [0] * self.world_size, timeout, "barrier"
        )

    def all_to_all(
        self,
        send: list[torch.Tensor],
        recv_bytes: list[int],
        timeout: float,
        what: str,
        exact=True,
        into=None,
        split=None,
        meanwhile=None,
    ):
        """``send[r]`` (uint8, 1-D) to rank r; returns views of one receive tensor, ``recv_bytes[r]`` from rank r
        (evenly spaced when the sizes are equal). ``exact`` False: ``recv_bytes[r]`` bounds what rank r sends and
        its view holds what it sent (the header's size; each view starts where it would with the bounds).

        A payload in two parts, the first received straight into the caller's memory (``exact`` only):
        ``split[r]`` (0: one part) sends the first ``split[r]`` bytes of ``send[r]`` as a message of their own
        (the header then says where the parts meet: :data:`SPLIT_HEAD` bytes); ``into[r]`` (None, or a contiguous
        uint8 tensor) receives the first ``into[r].numel()`` bytes of rank r's ``recv_bytes[r]``, no copy between,
        and rank r's view holds the rest.

        ``meanwhile`` (``exact`` only): called once the sends are posted, before any wait, with every payload's
        receive posted too (not only after its header arrived, as otherwise), so that the payloads move while it
        runs. The sizes must then be ones every rank agreed on before: a payload longer than its posted receive
        ends the process in gloo (module docstring), not in a ValueError. TimeoutError names a silent peer;
        ValueError a peer whose message was not this exchange's (or larger than its bound, or not split where
        ``into`` says)."""
        me, w = self.rank, self.world_size
        own = send[me].numel()
        into, split = into or [None] * w, split or [0] * w
        first = self._check_call(send, recv_bytes, what, exact, into, split, meanwhile)
        deadline = deadline_after(timeout)
        self._exchanges += 1
        n = self._exchanges
        tag = 3 * (n % _TAGS)
        rest = [b - f for b, f in zip(recv_bytes, first)]
        views = list(torch.split(self._receive_space(sum(rest)), rest))
        if self._heads is None:
            self._heads = torch.empty((w, _HEAD + INLINE_BYTES), dtype=torch.uint8)
        heads = self._heads

        def receives(src: int) -> list:
            return self._post_payload(src, first[src], into[src], views[src], tag)

        got, posted, sent = {}, {}, []  # type: ignore[var-annotated]  # (filled below)
        try:
            got.update(self._post_heads(heads, tag))
            for src in got if meanwhile else ():
                posted[src] = receives(src)
            self._send_all(send, split, n, tag, sent)
            views[me] = views[me][:own]
            if own:
                views[me].copy_(send[me])
            if meanwhile is not None:
                meanwhile()
                deadline = time.monotonic() + timeout  # the caller's work is not the peers' time
            for src, work in got.items():
                self._wait(work, deadline, timeout, src, what)
                head = heads[src][:SPLIT_HEAD].view(torch.int64).tolist()
                nbytes = self._check_header(head, src, n, recv_bytes[src], exact, what, first[src])
                if not first[src]:
                    views[src] = views[src][:nbytes]
                if nbytes and _inline(nbytes, head[2] & _SPLIT):
                    views[src].copy_(heads[src][_HEAD : _HEAD + nbytes])
                    continue
                works = posted[src] if src in posted else receives(src)
                for work in works:
                    self._wait(work, deadline, timeout, src, what)
            for dst, _, work in sent:
                self._wait(work, deadline, timeout, dst, f"{what} (receipt of this rank's)")
        except BaseException:
            # requests may still be posted into (or from) these: never freed
            _RETIRED.append((self.pg, self._recv, heads, sent, into, posted))
            self._recv = torch.empty(0, dtype=torch.uint8)
            self._heads = None
            self._staging.clear()  # a send may still read its staging: a later exchange gets fresh memory
            raise
        return views

    def _check_call(self, send, recv_bytes, what: str, exact: bool, into, split, meanwhile) -> list[int]:
        """``all_to_all``'s arguments checked (ValueError); returns the bytes of each source's first part."""
        me = self.rank
        own = send[me].numel()
        if own > recv_bytes[me] or (exact and own != recv_bytes[me]):
            raise ValueError(
                f"{self.rank_name(me)}: its own {what} payload has {own} bytes, its receive {recv_bytes[me]}"
            )
        if meanwhile is not None and not exact:
            raise ValueError(f"{what}: posting receives before the headers needs exact sizes")
        first = [0 if t is None else t.numel() for t in into]
        for r, t in enumerate(into):
            if t is not None and not (exact and t.dtype == torch.uint8 and t.is_contiguous() and r != me):
                raise ValueError(
                    f"{what}: the memory for {self.rank_name(r)}'s first part must be contiguous bytes of a peer's"
                )
            if not 0 <= first[r] <= recv_bytes[r] or not 0 <= split[r] <= send[r].numel():
                raise ValueError(f"{what}: a part of {self.rank_name(r)}'s payload is larger than the payload")
        return first

    def _send_all(self, send, split, n: int, tag: int, sent: list) -> None:
        """Post exchange ``n``'s messages to every peer (header, then the payload in one part or two, or both in one
        message when small); appends ``(dst, tensor, work)`` per message sent to ``sent``."""
        me, w = self.rank, self.world_size
        for k in range(1, w):
            dst = (me + k) % w

            def post(msg: torch.Tensor, t: int, dst: int = dst) -> None:
                sent.append((dst, msg, self._post(self.pg.send, msg, dst, t)))

            nbytes, s1 = send[dst].numel(), split[dst]
            words = [self.buffer_id, n, nbytes | _SPLIT, s1] if s1 else [self.buffer_id, n, nbytes]
            head = torch.tensor(words, dtype=torch.int64).view(torch.uint8)
            if _inline(nbytes, s1):  # one message: the header and the payload
                post(torch.cat([head, send[dst].reshape(-1)]) if nbytes else head, tag)
            else:
                post(head, tag)
                payload = send[dst].contiguous()
                for part, t in ((payload[:s1], tag + 1), (payload[s1:], tag + 2)) if s1 else ((payload, tag + 1),):
                    if part.numel():
                        post(part, t)
            self.bytes_sent[dst] += head.numel() + nbytes

    def _receive_space(self, nbytes: int) -> torch.Tensor:
        """``[nbytes]`` uint8 for one exchange's incoming payloads, kept between exchanges (the views of one are
        read before the next begins: :class:`~epkit.collectives.exchange.Exchange` releases them first), so a
        large message does not fault in fresh pages on every call."""
        if self._recv.numel() < nbytes:
            self._recv = torch.empty(nbytes, dtype=torch.uint8)
        return self._recv[:nbytes]

    def _check_header(
        self, head: list[int], src: int, n: int, nbytes: int, exact: bool, what: str, first: int = 0
    ) -> int:
        """The payload bytes a header announces, checked: this buffer's, this exchange's, ``nbytes`` (``exact``)
        or at most ``nbytes``; split after ``first`` bytes when ``first``, else not split (``head``: the
        header's words and the word after)."""
        buffer_id, epoch, size = head[:3]
        split = head[3] if size & _SPLIT else 0
        size &= ~_SPLIT
        ok = size == nbytes if exact else 0 <= size <= nbytes
        if buffer_id != self.buffer_id or epoch != n or not ok or split != first:
            expected = f"{nbytes} bytes" if exact else f"at most {nbytes} bytes"
            if split != first:
                expected += f" split after {first} bytes" if first else " in one part"
            me, peer = self.rank_name(self.rank), self.rank_name(src)
            raise ValueError(
                f"{me}: {peer}'s {what} message is not this exchange's (buffer {buffer_id:x}, exchange "
                f"{epoch}, {size} bytes; expected buffer {self.buffer_id:x}, exchange {n}, {expected}): the ranks' "
                f"calls on this buffer are out of step"
            )
        return size

    def is_open(self) -> bool:
        return not self._closed

    def close(self, collective: bool) -> None:
        self._closed = True
        self.local = self._recv = torch.empty(0, dtype=torch.uint8)
        self._staging.clear()
        # The group's sockets go now, not when the garbage collector finds the buffer (a retired exchange's posted
        # requests keep their group alive in _RETIRED until they end).
        self.pg = None
