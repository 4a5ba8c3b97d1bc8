"""The one builder of the training loop, used by ``echorl train-local`` and ``echorl learner``.

Every training setting is a field of :class:`~echorl.rl.config.TrainingFields` (so both commands
have it as a flag); this module is the one place they become the loop's :class:`LoopSettings`,
the trainer's :class:`GRPOConfig` and the buffer's :class:`StalenessRule`. What differs between
the commands is only what they pass in: the task (loaded and checked by the command), the
checkpoint's identity (``meta``: the learner adds its run id) and whether the loop keeps every
metrics row (train-local prints a summary from them).

Compute-heavy (loads weights): call it in a worker thread from trio code.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from echorl.actor.backend import TorchBackend
from echorl.actor.device import resolve_device
from echorl.actor.model import default_model
from echorl.common.config import ModelFields
from echorl.rl.buffer import StalenessBuffer
from echorl.rl.config import TrainingFields
from echorl.rl.distributed import data_parallel
from echorl.rl.grpo import GRPOConfig, GRPOTrainer
from echorl.rl.loop import LoopSettings, TrainingLoop
from echorl.rl.replay import group_scorer
from echorl.tasks.chat import with_chat_template

if TYPE_CHECKING:
    from echorl.tasks.base import Task

#: ``--checkpoint-dir`` value that turns checkpoints off
NO_CHECKPOINTS = "none"
MAX_SAME_SECOND_RUNS = 1000
"""Runs of one name started within one second that each get their own default directory."""


def model_path(cfg: ModelFields) -> Path:
    """``--model``, else the shipped tiny model (built on first use)."""
    return Path(cfg.model) if cfg.model else default_model()


def grpo_config(cfg: TrainingFields, device: str, dtype: str, entropy_tokens: tuple[int, ...] = ()) -> GRPOConfig:
    """The trainer's hyper-parameters from a run's settings (``device``/``dtype`` resolved;
    ``entropy_tokens``: :func:`action_tokens`)."""
    return GRPOConfig(
        lr=cfg.lr,
        lr_schedule=cfg.lr_schedule,
        lr_min_ratio=cfg.lr_min_ratio,
        lr_steps=cfg.steps,
        weight_decay=cfg.weight_decay,
        clip_low=cfg.clip,
        clip_high=cfg.clip,
        tis_cap=cfg.tis_cap,
        max_grad_norm=cfg.max_grad_norm or None,
        micro_batch=cfg.micro_batch,
        kl_coef=cfg.kl_coef,
        kl_refresh=cfg.kl_refresh,
        entropy_coef=cfg.entropy_coef,
        entropy_schedule=cfg.entropy_schedule,
        entropy_final=cfg.entropy_final,
        entropy_tokens=entropy_tokens,
        loss_norm=cfg.loss_norm,
        adv_norm=cfg.adv_norm,
        off_policy_correction=cfg.off_policy_correction,
        decoupled=cfg.decoupled_correction,
        temperature=cfg.temperature,
        device=device,
        dtype=dtype,
        lora=cfg.lora_settings(),
    )


def loop_settings(cfg: TrainingFields, meta: dict[str, Any] | None = None) -> LoopSettings:
    """What the loop reads of a run's settings; ``meta`` (e.g. the learner's run id) goes into
    every checkpoint beside the task and seed."""
    return LoopSettings(
        steps=cfg.steps,
        staleness=cfg.staleness,
        prompts_per_step=cfg.prompts_per_step,
        publish_every=cfg.publish_every,
        eval_every=cfg.eval_every,
        eval_prompts=cfg.eval_prompts,
        seed=cfg.seed,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        checkpoint_dir=cfg.checkpoint_dir,
        checkpoint_every=cfg.checkpoint_every,
        metrics_out=cfg.metrics_out,
        meta={**(meta or {}), "task": cfg.task, "seed": cfg.seed},
    )


def action_tokens(task: Task, backend: TorchBackend) -> tuple[int, ...]:
    """The token ids of the task's legal actions (``legal_actions``), each one token, for
    ``--entropy-over actions``; a ValueError naming the task where it has none."""
    actions = list(getattr(task, "legal_actions", None) or [])
    ids = [backend.encode(a) for a in actions]
    if len(ids) < 2 or any(len(i) != 1 for i in ids):
        raise ValueError(
            f"--entropy-over actions needs a task with two or more one-token legal actions; {task.name} has {actions}"
        )
    return tuple(i[0] for i in ids)


def build_loop(
    cfg: TrainingFields, task: Task, *, meta: dict[str, Any] | None = None, keep_rows: bool = False
) -> TrainingLoop:
    """Model (``cfg.model`` or the default tiny model), GRPO trainer (data-parallel over
    ``cfg.nproc`` ranks), staleness buffer (episodic tasks: rewards by replay) and the held-out
    evaluation backend over the trainer's own model, in one loop."""
    import torch

    torch.manual_seed(cfg.seed)
    model_dir = model_path(cfg)
    device, dtype = resolve_device(cfg.device, cfg.dtype)
    backend = TorchBackend.from_pretrained(model_dir, device=device, dtype=dtype)
    tokens = action_tokens(task, backend) if cfg.entropy_over == "actions" else ()
    trainer = GRPOTrainer(backend.model, grpo_config(cfg, device, dtype, tokens))
    grpo = data_parallel(trainer, model_dir, cfg.nproc, cfg.seed)
    task = with_chat_template(task, backend.tokenizer, cfg.chat_template)  # single-turn prompts in the model's template
    replay = group_scorer(task, backend.tokenizer)  # episodic tasks: rewards come from replaying the episodes
    buffer = StalenessBuffer(
        cfg.staleness, scorer=None if replay else task.reward, group_scorer=replay, batch=cfg.prompts_per_step
    )
    return TrainingLoop(loop_settings(cfg, meta), task, grpo, buffer, backend, keep_rows=keep_rows)


def checkpoint_dir(value: str, name: str) -> str:
    """``--checkpoint-dir`` as given (``none``: no checkpoints, ""), else a new
    ``runs/<name>-<time>[-n]/checkpoints`` (``name`` made file-name safe; created here, so two runs
    started in the same second never share one): a run keeps its last checkpoint unless told not to."""
    if value.lower() == NO_CHECKPOINTS:
        return ""
    if value:
        return value
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._") or "run"
    stem = Path("runs") / f"{safe}-{time.strftime('%Y%m%d-%H%M%S')}"
    Path("runs").mkdir(exist_ok=True)
    for n in range(MAX_SAME_SECOND_RUNS):
        run_dir = stem.with_name(f"{stem.name}-{n}") if n else stem
        try:
            run_dir.mkdir()
        except FileExistsError:
            continue
        return str(run_dir / "checkpoints")
    raise FileExistsError(f"{stem}: {MAX_SAME_SECOND_RUNS} runs started in this second already")
