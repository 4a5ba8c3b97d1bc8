"""Multi-turn environments: the interface a user implements, the task adapter that turns an
environment into prompts (one environment seed per prompt), and the referee both ends use.

An :class:`Environment` is a small stateful object: ``reset(seed)`` starts an episode and returns
the first observation (the prompt), ``step(action)`` takes the text of one model turn and returns
an :class:`~echorl.tasks.base.EnvStep` (next observation, reward so far, done). It must be a
deterministic function of the seed and the actions: the learner never trusts a node's account of
an episode, it replays it from (seed, the model's actions) and compares every observation.

:class:`EnvTask` wraps an environment class so the rest of echorl sees a task: training prompt
``i`` is the episode of seed ``hash(seed, i)``, its text is the first observation, and
``prompt.meta["env_seed"]`` carries the seed. :class:`EpisodeRun` is the referee: the node's
rollout loop (``actor/episodes.py``) and the learner's replay (``learner/replay.py``) drive the
same code, so they end episodes (done, turn limit, token budget, environment error) identically.
An environment that raises ends that episode with reward 0 and a logged reason, never the run.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable
from typing import Any

from .base import EnvStep, Prompt, Task, TaskError, TurnPolicy
from .selfplay import SelfPlay

log = logging.getLogger("echorl.tasks.env")

EVAL_SALT = "eval"
MAX_TURNS = 256  # protocol bound on an episode's turns (EpisodeSpec.max_turns)
WRAPPER_OPTIONS = ("seed", "n_eval", "max_turns", "self_play")


class Environment:
    """Base class of multi-turn environments (subclass it; name it as ``module:Class``).

    Attributes:
        name: short name used in prompt ids and metrics.
        max_turns: model turns before the episode is cut (the reward so far is kept).
        max_action_tokens: tokens of one model turn (the sampling length of a turn).
        stop: stop strings that end a model turn early (the EOS token always does).
        n_eval: held-out episodes evaluated (mean reward over them is ``eval_reward``).
        legal_actions: optional; the turns the environment accepts, each one token
            (``--entropy-over actions`` puts the entropy bonus on the choice among them).

    Constructor keyword arguments are the environment's options (``--task-option``); they travel
    to the nodes with every lease, so keep them plain scalars.
    """

    name: str = "env"
    max_turns: int = 8
    max_action_tokens: int = 4
    stop: list[str] = []
    n_eval: int = 256

    def reset(self, seed: int) -> str:
        """Start the episode of ``seed``; return the first observation (the prompt text)."""
        raise NotImplementedError

    def step(self, action: str) -> EnvStep:
        """Apply the text of one model turn; return the next observation, reward and done."""
        raise NotImplementedError


def episode_seed(seed: int, index: int, salt: str = "train") -> int:
    """A 63-bit environment seed for prompt ``index`` of a run seeded ``seed``."""
    digest = hashlib.sha256(f"{salt}:{int(seed)}:{int(index)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


class EpisodeRun:
    """One episode under the referee's rules (shared by the rollout loop and the replay).

    ``observation`` is the prompt after construction; :meth:`act` applies one action and returns
    the observation that precedes the next model turn, or None once the episode is over. Over:
    the environment said done, ``max_turns`` actions were taken, or it raised (``reward`` 0,
    ``error`` says why). ``finish`` is ``"done"``, ``"turn_limit"``, ``"length"`` or
    ``"env_error"``.
    """

    def __init__(self, make_env: Callable[[], Environment], seed: int, max_turns: int) -> None:
        self.turns = 0
        self.max_turns = int(max_turns)
        self.reward = 0.0
        self.over = False
        self.finish = ""
        self.error: str | None = None
        self.env: Environment | None = None
        self.observation = ""
        try:
            self.env = make_env()
            obs = self.env.reset(int(seed))
            if not isinstance(obs, str) or not obs:
                raise TypeError(f"reset returned {obs!r}: the first observation must be a non-empty str")
            self.observation = obs
        except Exception as exc:
            self._fail(f"reset({seed}): {type(exc).__name__}: {exc}")

    def _fail(self, reason: str) -> None:
        self.over, self.finish, self.reward, self.error = True, "env_error", 0.0, reason[:500]
        log.warning("episode ended by an environment error: %s", self.error)

    def act(self, action: str) -> str | None:
        """Apply one model turn; the next observation, or None when the episode is over."""
        if self.over or self.env is None:
            return None
        self.turns += 1
        try:
            st = self.env.step(action)
            if not isinstance(st, EnvStep):
                raise TypeError(f"step returned {type(st).__name__}, not EnvStep")
            reward = float(st.reward)
            if not math.isfinite(reward):
                raise ValueError(f"non-finite reward {st.reward!r}")
            if not st.done and not isinstance(st.observation, str):
                raise TypeError("an episode that goes on needs a str observation")
        except Exception as exc:
            self._fail(f"step {self.turns} ({action!r}): {type(exc).__name__}: {exc}")
            return None
        self.reward = reward
        if st.done:
            self.over, self.finish = True, "done"
            return None
        if self.turns >= self.max_turns:
            self.over, self.finish = True, "turn_limit"
            return None
        self.observation = st.observation or ""
        return self.observation

    def cut(self) -> None:
        """End the episode because the transcript's token budget is spent (reward so far)."""
        self.over, self.finish = True, "length"


class EnvTask(Task):
    """A :class:`Task` over an environment class: prompts are episodes (see the module docstring).

    Options: ``seed`` (training seeds, default 0), ``n_eval`` (held-out episodes),
    ``max_turns`` (overrides the environment's), ``self_play`` (0: off; K: the training opponent is
    the mean of the policy's last K snapshots, ``tasks/selfplay.py``); every other option goes to
    the environment. A training prompt made under option overrides (self-play's opponent) carries
    them in ``meta["env_options"]``: its episodes are run and replayed under them.
    """

    episodic = True
    max_episode_tokens = 2048  # token budget of one transcript after the prompt (protocol: EpisodeSpec.max_tokens)

    def __init__(
        self,
        env_cls: type,
        spec: str,
        seed: int = 0,
        n_eval: int | None = None,
        max_turns: int | None = None,
        self_play: int = 0,
        **env_options: Any,
    ) -> None:
        super().__init__()
        self.env_cls, self.spec, self.env_options = env_cls, spec, dict(env_options)
        self.seed = int(seed)
        probe = self.make_env()  # a bad option is a TaskError now, not on the first lease
        self.name = str(getattr(probe, "name", "env"))
        self.max_turns = int(max_turns if max_turns is not None else getattr(probe, "max_turns", 8))
        self.max_new_tokens = int(getattr(probe, "max_action_tokens", 4))
        self.stop = [str(s) for s in (getattr(probe, "stop", None) or [])]
        self.legal_actions = [str(a) for a in (getattr(probe, "legal_actions", None) or [])]
        self.n_eval = int(n_eval if n_eval is not None else getattr(probe, "n_eval", 256))
        if not 1 <= self.max_turns <= MAX_TURNS:
            raise TaskError(f"{spec}: max_turns must be in 1..{MAX_TURNS}, got {self.max_turns}")
        if not 1 <= self.max_new_tokens <= 4096 or not 1 <= self.n_eval <= 100_000:
            raise TaskError(f"{spec}: max_action_tokens must be in 1..4096 and n_eval in 1..100000")
        self.self_play = SelfPlay(probe, self_play) if self_play else None  # type: ignore[arg-type]

    def make_env(self, overrides: dict[str, Any] | None = None) -> Environment:
        """The environment under the task's options, ``overrides`` (a prompt's) on top; wrapper
        options among them (a lease's ``EpisodeSpec.options`` carries ``max_turns``) are not the
        environment's and are left out."""
        options = dict(self.env_options)
        options.update({k: v for k, v in (overrides or {}).items() if k not in WRAPPER_OPTIONS})
        try:
            return self.env_cls(**options)
        except TaskError:
            raise
        except (TypeError, ValueError) as exc:
            raise TaskError(f"environment {self.spec!r}: bad options {options}: {exc}") from None

    def run(self, env_seed: int, overrides: dict[str, Any] | None = None) -> EpisodeRun:
        """A fresh episode of ``env_seed`` under the referee (``overrides``: a prompt's options)."""
        return EpisodeRun(lambda: self.make_env(overrides), env_seed, self.max_turns)

    def _prompt(self, pid: str, env_seed: int, overrides: dict[str, Any] | None = None) -> Prompt:
        meta: dict[str, Any] = {"env_seed": env_seed}
        if overrides:
            meta["env_options"] = dict(overrides)
        return Prompt(prompt_id=pid, text=self.run(env_seed, overrides).observation, meta=meta)

    def prompt_at(self, index: int) -> Prompt:
        play = None if self.self_play is None else self.self_play.options
        return self._prompt(f"{self.name}:{index}", episode_seed(self.seed, index), play)

    def eval_prompts(self) -> list[Prompt]:
        return [self._prompt(f"{self.name}:eval:{i}", episode_seed(0, i, EVAL_SALT)) for i in range(self.n_eval)]

    def exact_eval(self, prompts: list[Prompt], policy: TurnPolicy) -> float | None:
        """The environment's exact expected reward (its ``exact_eval(policy)``, over every episode
        it can start, so independent of ``prompts``), None if it has none."""
        exact = getattr(self.make_env(), "exact_eval", None)
        return None if exact is None else float(exact(policy))

    def exact_metrics(self, prompts: list[Prompt], policy: TurnPolicy) -> dict[str, float]:
        """The environment's further exact figures (its ``exact_metrics(policy)``), if any."""
        extra = getattr(self.make_env(), "exact_metrics", None)
        return {} if extra is None else {str(k): float(v) for k, v in extra(policy).items()}

    def reward(self, prompt: Prompt, completion_text: str) -> float:
        raise TaskError(f"{self.spec}: an episodic task is scored by replaying its episodes, not from text")

    def env_step(self, prompt: Prompt, transcript: str) -> EnvStep:
        raise TaskError(f"{self.spec}: use EnvTask.run(seed) for episodes")


def is_episodic(task: Any) -> bool:
    return bool(getattr(task, "episodic", False))


def env_options_of(task: Any, prompt: Prompt | None = None) -> dict[str, Any]:
    """The options a node needs to build the same environment (wrapper options included) for
    ``prompt``'s episodes (its own overrides on top)."""
    overrides = {} if prompt is None else prompt.meta.get("env_options") or {}
    return {**task.env_options, **overrides, "max_turns": task.max_turns}
