"""API keys, sessions, who owns what, and what each session used.

- :func:`load_keys`: the ``--api-keys FILE`` (one key a line, ``tml-`` prefixed because the
  Tinker client refuses any other; an optional second word names the user; ``#`` comments).
- :class:`SessionBook`: sessions created by a key; the training clients (models) and sampling
  sessions each session made; heartbeats and expiry; per-session :class:`Usage`. Every lookup
  takes the caller's session, so one session can never name another's model, sampler, future or
  checkpoint: what is not its own is "not found", the same answer as what does not exist.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .engine import Snapshot

KEY_PREFIX = "tml-"
MAX_KEY_LEN = 256
"""Longer header values are refused before hashing (a key is a few dozen characters)."""


class KeyFileError(ValueError):
    """The API key file cannot be used: one line, exit 2."""


class NotFound(LookupError):
    """No such session/model/sampler for this caller (also: it belongs to someone else)."""


def load_keys(path: str | Path) -> dict[str, str]:
    """sha256(key) -> user name, from the key file."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise KeyFileError(f"cannot read API key file {path}: {exc.strerror or exc}") from None
    keys: dict[str, str] = {}
    for n, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        key, user = words[0], (words[1] if len(words) > 1 else f"user{len(keys) + 1}")
        if not key.startswith(KEY_PREFIX) or len(key) < len(KEY_PREFIX) + 16 or len(key) > MAX_KEY_LEN:
            raise KeyFileError(
                f"{path}:{n}: a key must start with {KEY_PREFIX!r} and have 16 to {MAX_KEY_LEN} characters after it"
            )
        keys[hashlib.sha256(key.encode()).hexdigest()] = user
    if not keys:
        raise KeyFileError(f"{path}: no API keys")
    return keys


def check_key(keys: dict[str, str], presented: str | None) -> str | None:
    """The user a presented key belongs to, or None (constant-time over the digest)."""
    if not presented or len(presented) > MAX_KEY_LEN:
        return None
    digest = hashlib.sha256(presented.encode()).hexdigest()
    for known, user in keys.items():
        if hmac.compare_digest(known, digest):
            return user
    return None


@dataclass
class Usage:
    """What a session used; ``cost`` is its compute time priced per hour (``--price-per-hour``)."""

    requests: int = 0
    tokens_sampled: int = 0
    tokens_sampled_by_nodes: int = 0  # of tokens_sampled: by swarm nodes (their pay is in the receipts)
    tokens_trained: int = 0
    tokens_forward: int = 0
    compute_s: float = 0.0
    cost: float = 0.0

    def add(
        self, seconds: float, sampled: int, trained: int, forward: int, price_per_hour: float, by_nodes: int = 0
    ) -> None:
        """One completed request (``by_nodes``: of ``sampled``, the tokens swarm nodes sampled)."""
        self.requests += 1
        self.tokens_sampled += sampled
        self.tokens_sampled_by_nodes += by_nodes
        self.tokens_trained += trained
        self.tokens_forward += forward
        self.compute_s += seconds
        self.cost = self.compute_s / 3600.0 * price_per_hour

    def as_dict(self) -> dict[str, float]:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}


@dataclass
class Sampler:
    """A sampling session: a snapshot of weights, owned by a session."""

    ident: str
    base_model: str
    model_path: str | None
    snapshot: Snapshot


@dataclass
class Session:
    ident: str
    user: str
    created: float
    last_seen: float
    models: dict[str, int] = field(default_factory=dict)  # model_id -> lora rank
    samplers: dict[str, Sampler] = field(default_factory=dict)
    usage: Usage = field(default_factory=Usage)
    finished: bool = False
    sampler_seq: int = 0


class SessionBook:
    """Every live session, by id; bounded by ``max_sessions``, idle ones expire after ``ttl_s``."""

    def __init__(self, max_sessions: int, max_models: int, max_samplers: int, ttl_s: float, price_per_hour: float):
        self.max_sessions = max_sessions
        self.max_models = max_models
        self.max_samplers = max_samplers
        self.ttl_s = ttl_s
        self.price_per_hour = price_per_hour
        self.sessions: dict[str, Session] = {}
        self.by_user: dict[str, Usage] = {}  # every session a user ever had, ended ones included

    def create(self, user: str) -> Session:
        if len(self.sessions) >= self.max_sessions:
            raise OverflowError(f"the server holds {self.max_sessions} sessions, its maximum; try later")
        now = time.monotonic()
        s = Session(ident=f"s-{secrets.token_hex(8)}", user=user, created=now, last_seen=now)
        self.sessions[s.ident] = s
        return s

    def get(self, user: str, ident: str) -> Session:
        s = self.sessions.get(ident)
        if s is None or s.user != user:
            raise NotFound(f"no session {ident!r}")
        s.last_seen = time.monotonic()
        return s

    def owner_of_model(self, user: str, model_id: str) -> Session:
        """The caller's session that made ``model_id`` (``<session>:train:<n>``)."""
        session_id = model_id.split(":", 1)[0]
        s = self.sessions.get(session_id)
        if s is None or s.user != user or model_id not in s.models:
            raise NotFound(f"no model {model_id!r}")
        s.last_seen = time.monotonic()
        return s

    def add_model(self, s: Session, model_id: str, rank: int) -> None:
        if len(s.models) >= self.max_models:
            raise OverflowError(f"a session holds at most {self.max_models} training clients")
        s.models[model_id] = rank

    def add_sampler(self, s: Session, sampler: Sampler) -> None:
        s.samplers[sampler.ident] = sampler
        while len(s.samplers) > self.max_samplers:  # the oldest snapshot goes first
            s.samplers.pop(next(iter(s.samplers)))

    def sampler(self, user: str, ident: str) -> tuple[Session, Sampler]:
        session_id = ident.split(":", 1)[0]
        s = self.sessions.get(session_id)
        if s is None or s.user != user or ident not in s.samplers:
            raise NotFound(
                f"no sampling session {ident!r} (or it expired: a session keeps its {self.max_samplers} newest)"
            )
        s.last_seen = time.monotonic()
        return s, s.samplers[ident]

    def charge(
        self, s: Session, seconds: float, sampled: int = 0, trained: int = 0, forward: int = 0, by_nodes: int = 0
    ) -> None:
        s.usage.add(seconds, sampled, trained, forward, self.price_per_hour, by_nodes)
        self.by_user.setdefault(s.user, Usage()).add(seconds, sampled, trained, forward, self.price_per_hour, by_nodes)

    def expired(self, now: float | None = None) -> list[Session]:
        """Sessions idle past ``ttl_s`` (or finished), removed from the book; the caller frees their models."""
        now = time.monotonic() if now is None else now
        gone = [s for s in self.sessions.values() if s.finished or now - s.last_seen > self.ttl_s]
        for s in gone:
            del self.sessions[s.ident]
        return gone

    def summary(self) -> list[dict[str, object]]:
        return [
            {
                "session": s.ident,
                "user": s.user,
                "models": len(s.models),
                "samplers": len(s.samplers),
                **s.usage.as_dict(),
            }
            for s in self.sessions.values()
        ]
