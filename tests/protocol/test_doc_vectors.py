"""docs/protocol.md's worked examples (§13) and its list of signed messages (§5) are test vectors:
each is rebuilt from the implementation and compared, so the contract a foreign peer is written
from cannot drift from the code (issue 24, finding 8)."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from echorl.protocol import limits, wire
from echorl.protocol import messages as m
from echorl.protocol.identity import Identity

DOC = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()
EXAMPLES = DOC[DOC.index("## 13. Worked examples") :]


def _block_bytes(block: str) -> bytes:
    """The hex of a code block: each line's text before a run of 2+ spaces (the annotation)."""
    return bytes.fromhex("".join(re.split(r"\s{2,}", line.strip())[0].replace(" ", "") for line in block.splitlines()))


def _blocks() -> list[bytes]:
    return [_block_bytes(b) for b in re.findall(r"```\n(.*?)```", EXAMPLES, re.S)]


def _after(label: str, pattern: str) -> str:
    found = re.search(pattern, EXAMPLES[EXAMPLES.index(label) :], re.S)
    assert found, f"{label}: no {pattern!r}"
    return found.group(1)


def test_lease_request_and_status_request_encode_as_documented() -> None:
    payload = wire.encode(m.LeaseRequest(run_id="run-1", version=4, max_prompts=16))
    assert payload == _blocks()[0]
    assert len(payload) == int(_after("**LeaseRequest**", r"encodes to (\d+) bytes"))
    assert wire.frame(payload).hex() == _after("The whole frame", r"`([0-9a-f]{20,})`")
    assert wire.frame(wire.encode(m.StatusRequest())).hex() == _after("**StatusRequest**", r"`([0-9a-f]{20,})`")


def test_the_signed_join_request_is_signed_and_verified_as_documented() -> None:
    ident = Identity(bytes(range(32)))
    cap = m.Capability(
        engine="torch",
        device="cpu",
        memory_bytes=8589934592,
        tokens_per_s=100.0,
        price_per_hour=0.0,
        reachable=True,
        listen_addrs=[],
    )
    join = m.JoinRequest(
        run_id="run-1", peer_id=ident.peer_id, capability=cap, version=-1, timestamp=1700000000.0, nonce=bytes(16)
    )
    signed_bytes = wire.canonical_bytes(join)
    assert signed_bytes == _blocks()[1]
    assert len(signed_bytes) == int(_after("**Signed JoinRequest.**", r"signed bytes \((\d+) bytes"))
    assert hashlib.sha256(signed_bytes).hexdigest() == _after("**Signed JoinRequest.**", r"SHA-256 is `([0-9a-f]{64})`")
    signature = _after("**Signed JoinRequest.**", r"signature is\s*`([0-9a-f]{128})`")
    signed = wire.sign(join, ident)
    assert signed.signature.hex() == signature
    documented = join.model_copy(update={"signature": bytes.fromhex(signature)})
    wire.verify(wire.decode(wire.encode(documented)), ident.peer_id)  # what a foreign peer sends verifies


def test_section_5_lists_every_signed_message() -> None:
    section = DOC[DOC.index("## 5. Signatures") : DOC.index("## 6.")]
    listed = set(re.findall(r"`([A-Z][A-Za-z]+)`", section.split("All others", 1)[0]))
    signed = {
        name
        for name, cls in vars(m).items()
        if isinstance(cls, type) and issubclass(cls, m.Message) and cls.__dict__.get("SIGNED") is True
    }
    assert signed and listed == signed


# --- numbers and tables the doc shares with the code (issue 24, finding 8) ------------------------
def _section(start: str, end: str) -> str:
    return DOC[DOC.index(start) : DOC.index(end)]


def _number(text: str) -> float:
    """A documented number: thin/normal spaces between digit groups allowed (``57 344``)."""
    return float(re.sub(r"[  ]", "", text))


def _find(pattern: str, text: str = DOC) -> tuple[str, ...]:
    found = re.search(pattern, text, re.S)
    assert found, f"docs/protocol.md no longer says {pattern!r}"
    return found.groups()


def _route_rows() -> dict[str, list[str]]:
    """§1.1's table: protocol id -> its cells (request, reply, cap, rate limit, served by)."""
    table = _section("### 1.1 Protocol IDs", "**The submit cap.**")
    rows = {}
    for line in table.splitlines():
        if line.startswith("| `/echorl/"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            rows[cells[0].strip("`")] = cells[1:]
    return rows


def test_the_route_table_is_the_code_s() -> None:
    """Every stream id with its request type and cap (``ROUTES``) and rate limit (``RATES``)."""
    from echorl.net.routes import RATES
    from echorl.protocol.routes import ROUTES, SUBMIT

    rows = _route_rows()
    assert set(rows) == set(ROUTES)
    for rid, (request, _reply, cap, rate, _served) in rows.items():
        route = ROUTES[rid]
        assert re.findall(r"`([A-Za-z]+)`", request)[0] == route.request.__name__, rid
        amount, unit = _find(r"(\d+) (KiB|MiB)", cap)
        assert int(amount) * {"KiB": limits.KiB, "MiB": limits.MiB}[unit] == route.max_request_bytes, rid
        assert ("submit cap" in cap) == (rid == SUBMIT), rid  # the one cap the learner lowers per run
        documented = None if rate == "—" else tuple(float(x) for x in rate.split(", "))
        limit = RATES.get(rid)
        assert documented == (None if limit is None else (limit.rate, limit.burst)), rid


def test_every_route_is_in_the_admission_table() -> None:
    """§1.1 "Who may call which route" names every stream id (by its short name)."""
    from echorl.protocol.routes import ROUTES

    table = _section("**Who may call which route.**", "Past the admission check")
    named = set(re.findall(r"`([a-z/]+)`", table))
    assert {rid.removeprefix("/echorl/").removesuffix("/1") for rid in ROUTES} <= named


def _admission_rows() -> dict[str, str]:
    """§1.1 "Who may call which route": route short name -> what the learner admits."""
    table = _section("**Who may call which route.**", "Past the admission check")
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) == 3 and cells[0].startswith("`"):
            rows |= dict.fromkeys(re.findall(r"`([a-z/]+)`", cells[0]), cells[1])
    return rows


def test_the_learner_admits_its_control_routes_as_documented() -> None:
    """The learner's control routes (``LearnerService.install``): "anyone" is served with no
    sender check, "joined peers" behind the membership check, which refuses a stranger."""
    from echorl.learner.config import ServiceFields
    from echorl.learner.service import LearnerService
    from echorl.rl.buffer import StalenessBuffer
    from echorl.tasks import load_task

    class _Host:
        def serve(self, handlers: dict, admit: dict | None = None, max_request_bytes: object = None) -> None:
            self.handlers, self.admit = handlers, admit or {}

    settings = ServiceFields(group_size=2, prompts_per_lease=2, prompts_per_step=2, staleness=2)
    svc = LearnerService(
        Identity.generate(), "run", load_task("addition", digits=2), None, StalenessBuffer(2), settings, 100
    )
    host = _Host()
    svc.install(host)  # type: ignore[arg-type]
    documented = _admission_rows()
    for rid in host.handlers:
        name = rid.removeprefix("/echorl/").removesuffix("/1")
        admit = host.admit.get(rid)
        assert documented[name] == ("anyone" if admit is None else "joined peers"), name
        assert admit is None or not admit(Identity.generate().peer_id), name  # a stranger is refused


def test_the_submit_cap_is_the_documented_formula() -> None:
    from echorl.learner.admission import submit_cap
    from echorl.learner.config import LearnerConfig

    mib, base, per_group, per_sample, per_token = (
        _number(x) for x in _find(r"min\((\d+) MiB, ([\d  ]+) \+ P × \(([\d  ]+) \+ G × \((\d+) \+ (\d+) × T\)\)\)")
    )

    def documented(t: int, g: int, p: int) -> int:
        return int(min(mib * limits.MiB, base + p * (per_group + g * (per_sample + per_token * t))))

    for t, g, p in [(1, 1, 1), (32, 8, 8), (12, 64, 256), (2048, 16, 32), (32_768, 64, 256)]:
        assert submit_cap(t, g, p) == documented(t, g, p), (t, g, p)
    t, cap = _find(r"At the defaults with T = (\d+) the cap is ([\d  ]+) bytes")
    fields = LearnerConfig.model_fields
    defaults = fields["group_size"].default, fields["prompts_per_lease"].default
    assert submit_cap(int(t), *defaults) == _number(cap)


def test_config_defaults_quoted_in_the_doc_are_the_code_s() -> None:
    """Every "`setting` (N …)" of the doc that names a learner setting quotes its default."""
    from echorl.learner.config import LearnerConfig

    fields = LearnerConfig.model_fields
    quoted = re.findall(r"`([a-z_]+)`\s+\((?:default )?(\d[\d.  ]*)", DOC)
    checked = {name for name, _ in quoted if name in fields}
    for name, value in quoted:
        if name in fields:
            assert _number(value) == fields[name].default, f"{name}: doc {value!r}, code {fields[name].default}"
    assert {
        "max_leases_per_peer",
        "max_leases_per_ip",
        "lease_min_s",
        "expiry_backoff_s",
        "expiry_backoff_max_s",
        "refuse_after_expiries",
        "max_peers_per_ip",
        "idle_member_drop_s",
        "spot_check_ban_after",
        "liveness_after_s",
        "ping_timeout_s",
        "prompts_per_lease",
        "group_size",
        "spot_check_tolerance_mean",
        "spot_check_tolerance_max",
    } <= checked


def test_the_lease_limits_are_the_code_s() -> None:
    """§4.2 "Lease limits": each factor and window is the constant ``learner/pace.py`` or
    ``learner/newcomers.py`` holds."""
    from echorl.learner import newcomers, pace
    from echorl.learner.config import LearnerConfig

    text = _section("**Lease limits**", "When the run is over")
    ws = r"\s+"
    expected = {
        rf"once{ws}its{ws}last{ws}(\d+){ws}leases": pace.PROVEN_LEASES,
        rf"within{ws}the{ws}last{ws}(\d+){ws}s": newcomers.ASKING_WINDOW_S,
        rf"after{ws}its{ws}first,{ws}each{ws}for{ws}(\d+){ws}s": newcomers.EARNED_TTL_S,
        rf"less{ws}(\d+){ws}for{ws}each{ws}lease{ws}answered": newcomers.LATE_COST,
        rf"`deadline_s`{ws}is{ws}([\d.]+){ws}×": pace.DEADLINE_FACTOR,
        rf"at{ws}most{ws}([\d.]+){ws}×{ws}`lease_timeout_s`": pace.MAX_DEADLINE_BASES,
        rf"before{ws}anyone{ws}is{ws}measured,{ws}([\d.]+){ws}×": pace.DEADLINE_FACTOR,
        rf"between{ws}`lease_timeout_s`{ws}and{ws}([\d.]+){ws}×{ws}it": LearnerConfig.model_fields[
            "unmeasured_deadline_factor"
        ].default,
        rf"in{ws}([\d.]+){ws}×{ws}the{ws}reference's{ws}time": pace.SIZE_SLACK,
        rf"more{ws}than{ws}([\d.]+){ws}×{ws}the{ws}reference's{ws}time": pace.LATE_FACTOR,
    }
    for pattern, value in expected.items():
        assert _number(_find(pattern, text)[0]) == value, pattern


def test_the_documented_settling_rows_are_the_table_s() -> None:
    """§4.2: which numbered checks settle the lease is what ``CHECKS`` says, row by row."""
    from echorl.learner.checks import CHECKS

    first, last = _find(r"A refusal at steps (\d+) to (\d+) settles the lease")
    a, b, c = _find(r"a refusal at steps (\d+) to (\d+) or (\d+) does not settle it")
    settling = set(range(int(first), int(last) + 1))
    not_settling = set(range(int(a), int(b) + 1)) | {int(c)}
    assert settling | not_settling == set(range(1, len(CHECKS) + 1)) and not settling & not_settling
    assert settling == {i for i, row in enumerate(CHECKS, 1) if row.settle is not None}


def test_strikes_downloads_and_liveness_are_the_code_s() -> None:
    import inspect

    from libp2p.host.ping import ID as PING_ID

    from echorl.broadcast.broadcaster import Broadcaster
    from echorl.broadcast.chunk_server import ChunkServer
    from echorl.broadcast.relay import NODE_FETCH_LIMIT
    from echorl.learner.service import LearnerService
    from echorl.net.guard import RefusalStrikes

    strikes = RefusalStrikes()
    limit, window, ban = _find(r"admission check (\d+)\s+times within (\d+) s is struck off for (\d+) s")
    assert (int(limit), float(window), float(ban)) == (strikes.limit, strikes.window_s, strikes.ban_s)
    at_once = _find(r"`wrong_signer` \(§4\.2\) strikes the identity off at\s+once \(`RefusalStrikes\.(\w+)`")[0]
    assert callable(getattr(strikes, at_once))  # the behaviour: test_a_member_flooding_bad_signatures_is_struck_off…
    rate, burst = _find(r"on a node \((\d+) MiB/s, bursts of (\d+) MiB\)")
    assert (int(rate) * limits.MiB, int(burst) * limits.MiB) == (NODE_FETCH_LIMIT.rate, NODE_FETCH_LIMIT.burst)
    wait = _find(r"`Error\(rate_limited\)` past (\d+) s")[0]
    assert float(wait) == inspect.signature(ChunkServer).parameters["fetch_max_wait_s"].default
    assert set(re.findall(r"`(/ipfs/ping/[\d.]+)`", DOC)) == {str(PING_ID)}
    every, misses, each = _find(r"every (\d+) s, each member of a plan.*?(\d+) pings in a row missed \((\d+) s each\)")
    params = inspect.signature(Broadcaster).parameters
    every_s = params["liveness_every_s"].default
    assert (float(every), int(misses)) == (every_s, params["liveness_misses"].default)
    assert float(each) == max(5.0, every_s)  # Broadcaster._probe's ping timeout
    sweep = _find(r"sweep that decides whom to ping runs every ([\d.]+) s")[0]
    assert float(sweep) == inspect.signature(LearnerService.maintain).parameters["interval_s"].default


def test_the_plan_worked_example_is_the_planner_s() -> None:
    """§12's worked example: the hash order and every stripe's edges, recomputed."""
    from echorl.broadcast.store import plan_of
    from echorl.protocol.plan import PlanPeer, _shuffled, plan_broadcast

    section = DOC[DOC.index("**Worked example** (one-letter IDs") : DOC.index("## 13.")]
    k, seed = (int(x) for x in _find(r"k = (\d+), seed (\d+), `striped`", section))
    block = _find(r"```\n(.*?)```", section)[0]
    peers = [PlanPeer(p, p in "abcg", p == "d") for p in "abcdefg"]
    assert "`a`, `b`, `c`, `g` reachable, `d` not reachable and\npushing, `e`, `f` not reachable" in section
    order = _find(r"order: ([a-z ]+)\n", block)[0].split()
    assert order == [p.peer_id for p in _shuffled(peers, seed)]
    plan = plan_broadcast("L", list(reversed(peers)), k, seed)  # any input order: the same plan
    documented = {
        int(j): {p: tuple(cs.split()) for p, cs in re.findall(r"(\w+)→([a-z ]+)", edges)}
        for j, edges in re.findall(r"stripe (\d+): (.*)", block)
    }
    assert documented == {s.index: s.children for s in plan.stripes}
    assert plan.pushed("d", "c") and not plan.pushed("g", "d")
    ann = m.PlanAnnounce.model_construct(
        learner_peer_id="L",
        shape="striped",
        fanout=k,
        seed=seed,
        members=[
            m.PlanMember.model_construct(peer_id=p.peer_id, reachable=p.reachable, addrs=[], pushes=p.pushes)
            for p in peers
        ],
    )
    assert plan_of(ann).stripes == plan.stripes  # what a node derives from an announcement
