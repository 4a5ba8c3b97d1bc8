"""The Tinker API's operations, on echorl's engine, sessions and futures (no HTTP here).

Each method takes the authenticated user and the decoded request and returns what the endpoint
answers: a JSON-able dict, or for the asynchronous operations an ``UntypedAPIFuture``
(``{"request_id": …}``) whose result the client fetches with ``retrieve_future``. Request shapes are
the ``tinker.types`` models of tinker 0.38.0 and 0.21.0 (see :mod:`echorl.service.wire`); paths of
saved weights are ``echorl://<model_id>/weights/<name>`` (``sampler_weights`` for sampler saves),
and ``tinker://``/``logits://`` spellings of the same path are accepted.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from echorl.actor.types import SamplingParams

from . import wire
from .config import ServeConfig
from .engine import Engine, Snapshot
from .futures import FutureBook, Job, UserError, Worker
from .sessions import NotFound, Sampler, Session, SessionBook

if TYPE_CHECKING:
    from .swarm import Swarm

SCHEMES = ("echorl://", "tinker://", "logits://")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
PATH = re.compile(r"^(?P<model>s-[0-9a-f]{16}:train:\d{1,6})/(?P<kind>weights|sampler_weights)/(?P<name>[^/]+)$")


def sequence_ids(request_id: str, n: int) -> list[str]:
    """A sample request's ``sample_sequence_ids``, one per sample (tinker 0.38 asserts them)."""
    return [f"{request_id}:{i}" for i in range(n)]


class Api:
    """``swarm``: sampling by volunteer nodes (``--swarm``, ``service/swarm.py``); None: the server
    samples everything."""

    def __init__(self, cfg: ServeConfig, engine: Engine, model_name: str, swarm: Swarm | None = None) -> None:
        self.cfg = cfg
        self.engine = engine
        self.model_name = model_name
        self.swarm = swarm
        self.state_dir = Path(cfg.state_dir)
        self.sessions = SessionBook(
            cfg.max_sessions,
            cfg.max_models_per_session,
            cfg.max_samplers_per_session,
            cfg.session_ttl_s,
            cfg.price_per_hour,
        )
        self.futures = FutureBook(
            max_futures=max(1024, 4 * cfg.queue_size), keep_s=cfg.result_keep_s, poll_wait_s=cfg.poll_wait_s
        )
        self.worker = Worker(cfg.queue_size, user_errors=(UserError, wire.WireError, ValueError, NotFound))
        self.limits = wire.Limits(cfg.max_tokens_per_request, cfg.max_data_per_request)
        self._snapshots = 0

    # ------------------------------------------------------------ helpers

    def _future(self, user: str, kind: str, run: Any, after: Any = None, model_id: str | None = None) -> dict[str, Any]:
        fut = self.futures.create(user, kind, model_id)
        self.worker.submit(Job(future=fut, run=run, after=after))
        out: dict[str, Any] = {"request_id": fut.ident}
        if model_id:
            out["model_id"] = model_id
        return out

    def _base(self, name: str | None) -> None:
        if name and name != self.model_name:
            raise UserError(f"this server holds base model {self.model_name!r}, not {name!r}")

    def _path(self, model_id: str, kind: str, name: str) -> str:
        return f"{self.cfg.path_scheme}://{model_id}/{kind}/{name}"

    def _dir(self, model_id: str, kind: str, name: str) -> Path:
        return self.state_dir / model_id.replace(":", "_") / kind / name

    def _resolve(self, user: str, path: str) -> tuple[str, Path]:
        """The model id and directory of a saved-weights path the caller's key may read."""
        rest = next((path[len(s) :] for s in SCHEMES if isinstance(path, str) and path.startswith(s)), None)
        m = PATH.match(rest or "")
        if m is None or not NAME.match(m["name"]):
            raise UserError(
                f"not a checkpoint path of this server: {str(path)[:200]!r} (echorl://<model_id>/weights/<name>)"
            )
        src = self._dir(m["model"], m["kind"], m["name"])
        owner = (src / "owner").read_text().strip() if (src / "owner").is_file() else None
        if owner != user:
            raise NotFound(f"no checkpoint {path!r}")
        return m["model"], src

    # ------------------------------------------------------------ sessions

    def capabilities(self) -> dict[str, Any]:
        model = {"model_name": self.model_name, "max_context_length": self.engine.max_context}
        return {"supported_models": [{**model, "trainable": True, "sampleable": True}]}

    def create_session(self, user: str) -> dict[str, Any]:
        s = self.sessions.create(user)
        return {"type": "create_session", "session_id": s.ident, "info_message": f"echorl serve: {self.model_name}"}

    def heartbeat(self, user: str, session_id: str) -> Session:
        return self.sessions.get(user, session_id)

    def finish(self, user: str, session_id: str) -> None:
        s = self.sessions.get(user, session_id)
        s.finished = True
        self._free(s)

    def _free(self, s: Session) -> None:
        models, s.models = list(s.models), {}
        s.samplers.clear()
        if models:
            self.worker.submit(
                Job(future=self.futures.create("", "json"), run=lambda: [self.engine.delete(m) for m in models])
            )

    def expire(self) -> int:
        gone = self.sessions.expired()
        for s in gone:
            self._free(s)
        return len(gone)

    # ------------------------------------------------------------ training clients

    def create_model(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        s = self.sessions.get(user, str(body.get("session_id", "")))
        self._base(str(body.get("base_model", "")))
        lora = body.get("lora_config") or {}
        rank = int(lora.get("rank", 32))
        if not 1 <= rank <= self.cfg.max_lora_rank:
            raise UserError(f"LoRA rank must be 1..{self.cfg.max_lora_rank}, got {rank}")
        opt = body.get("optimizer_config") or {}
        if opt.get("type", "adamw") != "adamw":
            raise UserError(f"echorl serve trains with AdamW only, not {opt.get('type')!r}")
        seed = lora.get("seed")
        spec = self.engine.lora_spec(
            rank,
            self.cfg.lora_alpha,
            int(seed) if isinstance(seed, int) else 0,
            bool(lora.get("train_mlp", True)),
            bool(lora.get("train_attn", True)),
            bool(lora.get("train_unembed", True)),
        )
        model_id = f"{s.ident}:train:{int(body.get('model_seq_id', len(s.models)))}"
        if model_id in s.models:
            raise UserError(f"model {model_id} exists")
        self.sessions.add_model(s, model_id, rank)

        def run() -> dict[str, Any]:
            self.engine.create(model_id, spec)
            return {"model_id": model_id, "type": "create_model"}

        return self._future(user, "json", run, model_id=model_id)

    def get_info(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        model_id = str(body.get("model_id", ""))
        rank = self.sessions.owner_of_model(user, model_id).models[model_id]
        arch = (getattr(self.engine.config, "architectures", None) or ["unknown"])[0]
        data = {"arch": arch, "model_name": self.model_name, "tokenizer_id": str(self.engine.model_dir)}
        return {
            "type": "get_info",
            "model_data": data,
            "model_id": model_id,
            "is_lora": True,
            "lora_rank": rank,
            "model_name": self.model_name,
        }

    def unload_model(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        model_id = str(body.get("model_id", ""))
        s = self.sessions.owner_of_model(user, model_id)
        del s.models[model_id]

        def run() -> dict[str, Any]:
            self.engine.delete(model_id)
            return {"model_id": model_id, "type": "unload_model"}

        return self._future(user, "json", run, model_id=model_id)

    def forward_backward(self, user: str, req: wire.FwdBwdRequest) -> dict[str, Any]:
        s = self.sessions.owner_of_model(user, req.model_id)
        tokens = sum(len(d.tokens) for d in req.data)
        after = lambda _r, sec: self.sessions.charge(
            s, sec, trained=0 if req.forward_only else tokens, forward=tokens if req.forward_only else 0
        )
        return self._future(
            user, "fwdbwd", lambda: self.engine.forward_backward(req.model_id, req), after, req.model_id
        )

    def optim_step(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        model_id = str(body.get("model_id", ""))
        s = self.sessions.owner_of_model(user, model_id)
        p = body.get("adam_params") or body.get("optim_params") or {}
        if not isinstance(p, dict) or p.get("type", "adam") not in ("adam", "adamw"):
            raise UserError("optim_step needs adam_params (echorl serve trains with AdamW only)")
        vals = {
            k: float(p.get(k, d))
            for k, d in (
                ("learning_rate", 1e-4),
                ("beta1", 0.9),
                ("beta2", 0.95),
                ("eps", 1e-12),
                ("weight_decay", 0.0),
                ("grad_clip_norm", 0.0),
            )
        }
        if not (
            0 <= vals["learning_rate"] <= 10
            and 0 <= vals["beta1"] < 1
            and 0 <= vals["beta2"] < 1
            and 0 < vals["eps"] <= 1
            and vals["weight_decay"] >= 0
        ):
            raise UserError(f"Adam parameters out of range: {vals}")

        def run() -> dict[str, Any]:
            args = (
                vals["learning_rate"],
                vals["beta1"],
                vals["beta2"],
                vals["eps"],
                vals["weight_decay"],
                vals["grad_clip_norm"],
            )
            return {"metrics": self.engine.optim_step(model_id, *args), "type": "optim_step"}

        return self._future(user, "json", run, lambda _r, sec: self.sessions.charge(s, sec), model_id)

    # ------------------------------------------------------------ weights

    def _name(self, body: dict[str, Any], default: str) -> str:
        name = body.get("path") or default
        if not isinstance(name, str) or not NAME.match(name):
            raise UserError(f"checkpoint name must match {NAME.pattern}, got {str(name)[:80]!r}")
        return name

    def _write_owner(self, out: Path, user: str, model_id: str, kind: str) -> None:
        self.engine.save_state(model_id, out, {"base_model": self.model_name, "model_id": model_id})
        (out / "owner").write_text(user)
        if kind == "sampler_weights":
            (out / "optimizer.pt").unlink(missing_ok=True)

    def save_weights(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        model_id = str(body.get("model_id", ""))
        self.sessions.owner_of_model(user, model_id)
        name = self._name(body, f"state-{int(body.get('seq_id') or 0):06d}")
        out = self._dir(model_id, "weights", name)
        if out.exists() and not body.get("overwrite", False):
            raise UserError(f"checkpoint {name!r} exists (overwrite=True replaces it)")

        def run() -> dict[str, Any]:
            self._write_owner(out, user, model_id, "weights")
            return {"path": self._path(model_id, "weights", name), "type": "save_weights"}

        return self._future(user, "json", run, model_id=model_id)

    def save_weights_for_sampler(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        model_id = str(body.get("model_id", ""))
        s = self.sessions.owner_of_model(user, model_id)
        self._snapshots += 1
        ident = self._snapshots
        if body.get("path"):  # a named save: on disk, addressable by path
            name = self._name(body, "")
            out = self._dir(model_id, "sampler_weights", name)

            def run() -> dict[str, Any]:
                self._write_owner(out, user, model_id, "sampler_weights")
                return {"path": self._path(model_id, "sampler_weights", name), "type": "save_weights_for_sampler"}

            return self._future(user, "json", run, model_id=model_id)
        sampler_id = f"{s.ident}:sample:{s.sampler_seq}"
        s.sampler_seq += 1

        made: list[Snapshot] = []

        def snap() -> dict[str, Any]:
            made.append(self.engine.snapshot(model_id, ident))
            self.sessions.add_sampler(s, Sampler(sampler_id, self.model_name, None, made[0]))
            return {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}

        def publish(result: Any, seconds: float) -> None:  # on the event loop, before the client hears
            if self.swarm is not None and made:
                self.swarm.offer(made[0])

        return self._future(user, "json", snap, publish, model_id=model_id)

    def load_weights(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        src_model, src = self._resolve(user, str(body.get("path", "")))
        optimizer = bool(body.get("optimizer", False))
        if body.get("session_id"):  # create-via-load: a new training client from the checkpoint
            s = self.sessions.get(user, str(body["session_id"]))
            model_id = f"{s.ident}:train:{int(body.get('model_seq_id', len(s.models)))}"
            spec = self.engine.read_spec(src)
            if model_id in s.models:
                raise UserError(f"model {model_id} exists")
            self.sessions.add_model(s, model_id, spec.rank)

            def create_and_load() -> dict[str, Any]:
                self.engine.create(model_id, spec)
                self.engine.load_state(model_id, src, optimizer)
                return {"path": str(body["path"]), "model_id": model_id, "type": "load_weights"}

            return self._future(user, "json", create_and_load, model_id=model_id)
        model_id = str(body.get("model_id", ""))
        self.sessions.owner_of_model(user, model_id)

        def load() -> dict[str, Any]:
            self.engine.load_state(model_id, src, optimizer)
            return {"path": str(body["path"]), "model_id": model_id, "type": "load_weights"}

        return self._future(user, "json", load, model_id=model_id)

    # ------------------------------------------------------------ sampling

    def create_sampling_session(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        s = self.sessions.get(user, str(body.get("session_id", "")))
        path = body.get("model_path")
        snapshot = Snapshot(None, None)
        if path:
            _, src = self._resolve(user, str(path))
            from safetensors.torch import load_file

            self._snapshots += 1
            snapshot = Snapshot(
                self.engine.read_spec(src), load_file(str(src / "adapter.safetensors")), self._snapshots
            )
            if self.swarm is not None:
                self.swarm.offer(snapshot)
        else:
            self._base(str(body.get("base_model") or ""))
        sampler_id = f"{s.ident}:sample:{s.sampler_seq}"
        s.sampler_seq += 1
        self.sessions.add_sampler(s, Sampler(sampler_id, self.model_name, path, snapshot))
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    def get_sampler(self, user: str, sampler_id: str) -> dict[str, Any]:
        _, sampler = self.sessions.sampler(user, sampler_id)
        return {"sampler_id": sampler.ident, "base_model": sampler.base_model, "model_path": sampler.model_path}

    def _sampling_params(self, sp: Any) -> tuple[SamplingParams, int | None, list[int]]:
        if not isinstance(sp, dict):
            raise UserError("sampling_params must be an object")
        if int(sp.get("top_k", -1) or -1) > 0:
            raise UserError("top_k sampling is not served by echorl (use top_p)")
        max_tokens = sp.get("max_tokens") or self.cfg.max_new_tokens
        if not 1 <= int(max_tokens) <= self.cfg.max_new_tokens:
            raise UserError(f"max_tokens must be 1..{self.cfg.max_new_tokens}")
        stop = sp.get("stop")
        stop = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stop) > 16 or any(not isinstance(x, (str, int)) or isinstance(x, bool) for x in stop):
            raise UserError("stop must be at most 16 strings or token ids")
        words = [x[:256] for x in stop if isinstance(x, str)]
        params = SamplingParams(
            temperature=float(sp.get("temperature", 1.0)),
            top_p=float(sp.get("top_p", 1.0)),
            max_new_tokens=int(max_tokens),
            stop=words,
        )
        seed = sp.get("seed")
        return params, (int(seed) if isinstance(seed, int) else None), [x for x in stop if isinstance(x, int)]

    def sample(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        if body.get("sampling_session_id"):
            s, sampler = self.sessions.sampler(user, str(body["sampling_session_id"]))
            snapshot = sampler.snapshot
        else:
            raise UserError("sample needs a sampling_session_id (create a sampling client first)")
        n = int(body.get("num_samples", 1))
        if not 1 <= n <= self.cfg.max_samples:
            raise UserError(f"num_samples must be 1..{self.cfg.max_samples}")
        if int(body.get("topk_prompt_logprobs") or 0) or int(body.get("topk_sample_logprobs") or 0):
            raise UserError("top-k log-probs are not served by echorl")
        prompt = wire.model_input_tokens(body.get("prompt"))
        if not prompt or len(prompt) > self.limits.max_tokens_per_request:
            raise UserError(f"the prompt must have 1..{self.limits.max_tokens_per_request} tokens")
        params, seed, stop_tokens = self._sampling_params(body.get("sampling_params"))
        want_plp = bool(body.get("prompt_logprobs"))

        swarm = self.swarm
        if swarm is not None and swarm.takes(snapshot, prompt, params, seed, want_plp):
            fut = self.futures.create(user, "sample")

            def done(seqs: list[wire.Sequence], missing: int) -> None:  # the swarm's answer, on the event loop
                tokens = sum(len(q.tokens) for q in seqs)
                if not missing:
                    self.sessions.charge(s, 0.0, sampled=tokens, by_nodes=tokens)
                    FutureBook.finish(fut, result=wire.SampleResult(sequences=seqs, prompt_logprobs=None))
                    return

                def rest() -> wire.SampleResult:  # what the swarm did not finish, sampled here
                    more = self.engine.sample(snapshot, prompt, missing, params, seed, stop_tokens, False)
                    return wire.SampleResult(sequences=seqs + more.sequences, prompt_logprobs=None)

                def charged(result: wire.SampleResult, sec: float) -> None:
                    total = sum(len(q.tokens) for q in result.sequences)
                    self.sessions.charge(s, sec, sampled=total, by_nodes=tokens)

                try:
                    self.worker.submit(Job(future=fut, run=rest, after=charged))
                except OverflowError:
                    pass  # the future is finished with the queue's error

            swarm.submit(fut.ident, snapshot, prompt, n, params, stop_tokens, done)
            return {"request_id": fut.ident, "sample_sequence_ids": sequence_ids(fut.ident, n)}

        def run() -> wire.SampleResult:
            return self.engine.sample(snapshot, prompt, n, params, seed, stop_tokens, want_plp)

        def after(result: wire.SampleResult, sec: float) -> None:
            self.sessions.charge(s, sec, sampled=sum(len(q.tokens) for q in result.sequences))

        out = self._future(user, "sample", run, after)
        out["sample_sequence_ids"] = sequence_ids(out["request_id"], n)
        return out
