"""One stripe of one version into a relay: from its plan parent; if that parent fails, adopted by
the nearest live ancestor in the stripe; what is still missing, pulled chunk by chunk.

Adoption (issue 27, self-repair under churn): when a plan parent dies mid-version, its children
lose the rest of the stripe, and so does everything under them. Pulling the missing chunks one
request at a time from random holders, the learner last, took twice the no-churn time in the
namespace lab and had the learner upload 1.9 copies. Instead the orphan subscribes for the
stripe *but the chunks it holds* (``Subscribe.skip``) to its grandparent, and goes on
forwarding to its own children as before: one stream repairs the whole subtree. Whom it asks
next, the learner last, is ``broadcast/adoption.py``'s rule (ancestors, then uncles with room;
a stripe head's orphans their earlier siblings). A peer streams beyond its plan children only
to members after it in the stripe's breadth-first order, at most ``fanout`` descendants and
later siblings and ``adoption_slots`` nephews per stripe (``VersionState.adopt``: about one
more copy of the stripe at most, whatever a hostile member asks, and no two peers can wait on
each other), so a member refused there tries the next candidate.
Only the plan parent's failure is reported to the learner (``BroadcastDone.suspects``); an
ancestor that refuses or stalls an adoption may just have lost its own feed. A parent that
stalls but still answers a ping is asked once more before it counts as failed: it may be being
adopted itself.

Every chunk is verified against the signed manifest, whichever peer sent it.
"""

from __future__ import annotations

import logging

import trio

from echorl.broadcast.adoption import adopters
from echorl.broadcast.deadlines import Deadlines
from echorl.broadcast.push import PushInbox
from echorl.broadcast.recovery import recover_stripe
from echorl.broadcast.store import VersionState
from echorl.net.framing import STREAM_ERRORS, Truncated
from echorl.net.host import Host, PeerUnavailable
from echorl.net.transport import ChunkDialer, ChunkStream
from echorl.protocol import wire
from echorl.protocol.errors import ProtocolError
from echorl.protocol.identity import short_id
from echorl.protocol.messages import Chunk, Subscribe

log = logging.getLogger("echorl.broadcast.relay")

INLINE_HASH_BYTES = 512 * 1024  # chunks up to this size are hashed on the loop (< 0.5 ms)
PING_TIMEOUT_S = 2.0  # a stalled parent that is alive answers a ping well within this
#: what ends a stream from a parent or an adopter (and is logged, not raised)
SOURCE_FAILURES = (PeerUnavailable, Truncated, trio.TooSlowError, ProtocolError, *STREAM_ERRORS)


class StripeFeed:
    """Fills a ``VersionState``'s stripes at one relay (``Relay`` starts ``receive`` per stripe)."""

    def __init__(
        self,
        host: Host,
        run_id: str,
        pull: ChunkDialer,
        inbox: PushInbox,
        deadlines: Deadlines,
        stall_s: float,
        announce_wait_s: float,
    ) -> None:
        self.host = host
        self.run_id = run_id
        self.pull = pull  # opens streams to the peers we dial (plan parents, adopters)
        self.inbox = inbox  # streams pushed to us by parents behind NAT
        self.deadlines = deadlines
        self.stall_s = stall_s
        self.announce_wait_s = announce_wait_s
        self.adopted = 0  # stripes an ancestor completed after their parent failed (this relay's life)

    async def receive(self, state: VersionState, s: int, suspects: set[str], recovered: list[int]) -> None:
        """Stripe ``s`` of ``state``: parent, then adopters, then pulls (the caller's deadline
        bounds it all). A failed parent goes into ``suspects``; pulled chunks count in
        ``recovered[0]``."""
        parent = state.parents.get(s)
        if parent is not None and not state.stripe_complete(s):
            failure = await self._from_parent(parent, state, s)
            if failure is not None:
                log.info("v%d stripe %d: parent %s failed: %r", state.version, s, short_id(parent), failure)
                suspects.add(parent)
                await self._adopted(state, s, suspects)
        if not state.stripe_complete(s):
            await recover_stripe(
                self.host, state, s, state.plan.learner, suspects, recovered, self._pull_timeout(state)
            )

    async def _from_parent(self, parent: str, state: VersionState, s: int) -> Exception | None:
        """The stripe from its plan parent; what ended it, or None. A parent that stalls but still
        answers a ping is waited for once more, from where it stopped: it may be being adopted
        itself (its own parent failed), and its subtree must not walk away at the same moment
        (with a stall detected at every depth at once, each level would ask the same ancestors,
        which adopt ``fanout`` each). A pushed edge cannot be asked again: the parent dials us."""
        for again in (False, True):
            try:
                await self.stream(parent, state, s, resume=again)
                return None
            except trio.TooSlowError as exc:
                if again or state.plan.pushed(parent, self.host.peer_id) or not await self._answers(parent):
                    return exc
            except SOURCE_FAILURES as exc:
                return exc
        return None  # not reached: the second pass returns

    async def _answers(self, peer: str) -> bool:
        try:
            await self.host.ping(peer, timeout=min(self.stall_s, PING_TIMEOUT_S))
        except PeerUnavailable:
            return False
        return True

    async def _adopted(self, state: VersionState, s: int, suspects: set[str]) -> None:
        """The rest of stripe ``s`` from the first that adopts us (``broadcast/adoption.py``:
        ancestors above the failed parent, uncles with ``adoption_slots``, a stripe head's
        orphans their earlier siblings, the learner last). A dead candidate fails at its dial
        and the next is asked."""
        sources = adopters(state.plan, s, state.me)
        for source in sources:
            if state.stripe_complete(s):
                return
            if source in suspects or (source != state.plan.learner and source in state.plan.unreachable):
                continue  # a peer behind NAT cannot be dialled; it pushes to its plan children only
            try:
                await self.stream(source, state, s, resume=True)
            except SOURCE_FAILURES as exc:
                log.info("v%d stripe %d: %s did not adopt: %s", state.version, s, short_id(source), exc)
                continue
            if state.stripe_complete(s):
                self.adopted += 1
                log.info("v%d stripe %d: adopted by %s", state.version, s, short_id(source))

    async def open_source(self, source: str, state: VersionState, s: int, skip: int = 0) -> ChunkStream:
        if state.plan.pushed(source, self.host.peer_id):  # a plan parent that cannot be dialled dials us
            return await self.inbox.wait(state, s, source, self.stall_s + self.announce_wait_s)
        sub = Subscribe(run_id=self.run_id, version=state.version, stripe=s, skip=skip or None)
        return await self.pull.open(source, sub)

    async def stream(self, source: str, state: VersionState, s: int, resume: bool = False) -> None:
        """The stripe from ``source`` (when ``resume``, from the first chunk we lack: an
        adopter, or the plan parent asked again): each frame's first byte within ``stall_s``, its
        whole body within a chunk's deadline (its bytes at the floor rate), so a source that
        trickles is a stall too, not only one that goes silent. Only a plan parent's first
        stream is timed for the learner's uplink meter."""
        stream = await self.open_source(source, state, s, state.held_prefix(s) if resume else 0)
        chunk_deadline = self.deadlines.for_bytes(state.manifest.chunk_bytes)
        try:
            async for body in stream.frames(first_byte_timeout=self.stall_s, frame_timeout=chunk_deadline):
                msg = wire.decode(body, expect=Chunk)
                assert isinstance(msg, Chunk)
                if len(msg.data) <= INLINE_HASH_BYTES:
                    state.verify(msg.digest, msg.data)  # ~0.1 ms: cheaper than a thread hop
                else:
                    await trio.to_thread.run_sync(state.verify, msg.digest, msg.data)
                await state.put(msg.digest, msg.data, body)
                if not resume:
                    state.note_streamed(s, len(msg.data), stream.transit_s)
                if state.stripe_complete(s):
                    return
            if not state.stripe_complete(s):
                raise Truncated("the source ended the stream early")
        finally:
            await stream.aclose()

    def _pull_timeout(self, state: VersionState) -> float:
        return max(self.stall_s * 2, self.deadlines.for_bytes(state.manifest.chunk_bytes))
