"""The settings of a GRPO run with or without a network (``echorl train-local``; the learner's
``LearnerConfig`` extends them in ``learner/config.py``).

One pydantic model per role, built from sections so each field is defined once:
:class:`TrainingFields` (task, model, batch shape, GRPO, sampling, evaluation, checkpoints: every
training setting, so both roles have each as a flag; ``rl/build.py`` turns them into the loop's,
trainer's and buffer's settings). Fields whose default differs between roles (steps, staleness,
evaluation period and size) are typed once here as ``Annotated`` aliases. The command line is
made from these models by :mod:`echorl.common.config`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field, field_validator

from echorl.actor.lora import DEFAULT_TARGETS, LoraError, LoraSettings, check_model_targets
from echorl.common.config import ConfigError, Flag, ModelFields, Section
from echorl.protocol import limits
from echorl.rl.advantages import DEFAULT_ADV_NORM, AdvNorm
from echorl.rl.schedules import Schedule
from echorl.tasks import BUILTIN, parse_task_options

if TYPE_CHECKING:
    from echorl.tasks.base import Task

TOP_P_REFUSED = (
    "top_p < 1 is refused: the actors' behaviour log-probs and the learner's recomputed ones are of the "
    "untruncated distribution, which is not what nucleus sampling draws from; use --top-p 1"
)
"""Why ``--top-p`` must be 1 (the lease's ``SamplingSpec.top_p`` is bounded to 1 on the wire too)."""

Steps = Annotated[
    int, Field(ge=0, le=10**9, description="optimizer steps (versions) to train; the learner runs until stopped with 0")
]
Staleness = Annotated[
    int,
    Field(ge=0, le=10_000, description="staleness bound S: a rollout of version b is used at step t iff t - b <= S"),
]
PublishEvery = Annotated[int, Field(ge=0, le=10**6, description="publication period κ in steps (0: max(1, S-1))")]
FullEvery = Annotated[
    int, Field(ge=1, le=10**6, description="a full snapshot every this many publications, deltas between")
]
EvalEvery = Annotated[int, Field(ge=1, le=10**9, description="held-out evaluation period in steps (and at the end)")]
EvalPrompts = Annotated[
    int,
    Field(ge=0, le=10**6, description="held-out prompts per periodic evaluation (0: all; the last one uses all)"),
]
TaskOptions = Annotated[dict[str, int | float | bool | str], Flag("--task-option", parse=parse_task_options)]


class TaskFields(Section):
    """Which task prompts come from."""

    task: str = Field(
        "addition",
        min_length=1,
        description=f"a built-in task ({', '.join(BUILTIN)}, reasoning_gym:NAME) or package.module:Class "
        "(your own Task or Environment)",
    )
    task_options: TaskOptions = {}
    """task constructor option (the addition task's seed follows --seed)"""


class BatchFields(Section):
    """The shape of a step: what the buffer, the trainer and the lease service agree on."""

    staleness: Staleness = 4
    group_size: int = Field(8, ge=2, le=limits.MAX_GROUP_SIZE)
    """G samples per prompt"""
    prompts_per_step: int = Field(16, ge=1, le=100_000)
    """accepted groups per optimizer step (B)"""


class LoraFields(ModelFields):
    """Which model, and whether a LoRA adapter over it is trained instead of every weight."""

    lora_rank: int = Field(0, ge=0, le=limits.MAX_LORA_RANK)
    """LoRA rank: train a low-rank adapter over the frozen model and publish versions as adapters
    (0: full fine-tuning)"""
    lora_alpha: float = Field(0.0, ge=0.0, le=1e6)
    """LoRA alpha: the adapter's update is scaled by alpha/rank (0: 2 x rank)"""
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """dropout on the adapter's input while training"""
    lora_targets: Annotated[list[str], Flag("--lora-target", metavar="MODULE")] = Field(
        default_factory=lambda: list(DEFAULT_TARGETS), min_length=1, max_length=limits.MAX_LORA_TARGETS
    )
    """module the adapter wraps: the last part of a linear layer's name, e.g. q_proj (repeatable;
    default: every attention and MLP projection)"""
    chat_template: bool = True
    """wrap each prompt in the model's chat template when its tokenizer has one (single-turn tasks)"""

    def lora_settings(self) -> LoraSettings | None:
        """The adapter's settings; None: full fine-tuning."""
        return LoraSettings.from_flags(self.lora_rank, self.lora_alpha, self.lora_dropout, self.lora_targets)

    def lora_flags(self) -> list[str]:
        """These settings as the flags another role's command line takes (the demo's learner)."""
        targets = [a for t in self.lora_targets for a in ("--lora-target", t)]
        return [
            *("--lora-rank", str(self.lora_rank), "--lora-alpha", str(self.lora_alpha)),
            *("--lora-dropout", str(self.lora_dropout), *targets),
            "--chat-template" if self.chat_template else "--no-chat-template",
        ]

    def check_model(self) -> None:
        """The model directory, and with LoRA every target module in it: one line now, before training."""
        super().check_model()
        if self.lora_rank:
            try:
                check_model_targets(self.model, tuple(self.lora_targets))
            except LoraError as exc:
                raise ConfigError(str(exc)) from None


class TrainingFields(LoraFields, TaskFields, BatchFields):
    """Everything a GRPO run needs, with or without a network."""

    def check_task(self, task: Task) -> None:
        """What the settings need of the loaded task: one line now, before anything heavy loads."""
        actions = list(getattr(task, "legal_actions", None) or [])
        if self.entropy_over == "actions" and len(actions) < 2:
            raise ConfigError(f"--entropy-over actions needs a task with legal actions; {self.task!r} declares none")
        if self.kl_refresh and (self.lora_rank or not self.kl_coef):
            raise ConfigError("--kl-refresh needs --kl-coef > 0 and full fine-tuning (LoRA: the reference is the base)")

    steps: Steps = 0
    publish_every: PublishEvery = 0
    lr: float = Field(5e-4, ge=0.0, le=1.0)
    """AdamW learning rate (0 leaves the weights untouched)"""
    lr_schedule: Literal["constant", "cosine"] = "cosine"
    """'cosine': the learning rate falls from lr to lr_min_ratio × lr over the run's steps (a run that
    has found its policy stops kicking it out; a run without --steps keeps lr); 'constant': lr
    throughout. Default by measurement (docs/learning-notes.md §4: the demo's five seeds, poker)"""
    lr_min_ratio: float = Field(0.1, ge=0.0, le=1.0)
    """with the cosine schedule, the learning rate at the last step as a fraction of lr"""
    clip: float = Field(0.2, ge=0.0, le=10.0)
    """PPO clip epsilon"""
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    """sampling temperature"""
    weight_decay: float = Field(0.0, ge=0.0, le=10.0)
    """AdamW weight decay"""
    tis_cap: float = Field(2.0, ge=1.0, le=1e6)
    """truncation C of the importance weight π_θ/π_b where the advantage is negative"""
    max_grad_norm: float = Field(1.0, ge=0.0, le=1e6)
    """global gradient-norm clip (0: off)"""
    micro_batch: int = Field(256, ge=1, le=1_000_000)
    """sequences per forward/backward pass (gradients accumulate over micro-batches; memory, not math)"""
    kl_coef: float = Field(0.0, ge=0.0, le=100.0)
    """weight of the k3 KL penalty to the initial model (with --kl-refresh: to a moving magnet)"""
    kl_refresh: int = Field(0, ge=0, le=10**9)
    """copy the policy into the KL reference every this many steps (a moving magnet, as magnetic
    mirror descent's: the penalty then pulls towards the recent policy, not the start; 0: the initial
    model throughout; full fine-tuning only)"""
    entropy_coef: float = Field(0.0, ge=0.0, le=10.0)
    """weight of an entropy bonus on the model's turns (keeps a self-play policy mixed: a deterministic
    one makes every episode of a group alike, and a group of equal rewards teaches nothing)"""
    entropy_schedule: Schedule = "constant"
    """the bonus's weight over the run's steps: from --entropy-coef to --entropy-final along a line
    ('linear') or half a cosine ('cosine'), or --entropy-coef throughout ('constant'; so is a run
    without --steps). The bonus's own equilibrium is not Nash; annealing it moves it towards Nash"""
    entropy_final: float = Field(0.0, ge=0.0, le=10.0)
    """with a linear or cosine --entropy-schedule, the bonus's weight at the last step"""
    entropy_over: Literal["vocab", "actions"] = "vocab"
    """the bonus's entropy: over the whole vocabulary, or over the task's legal one-token actions
    renormalised ('actions': poker's 0/1; widens the choice without moving mass onto illegal answers)"""
    off_policy_correction: bool = True
    decoupled_correction: bool = False
    """the decoupled correction (AReaL): clip against the learner's own policy at the step's start and
    weight each token by the truncated π/π_behaviour ratio, so an engine's log-prob mismatch scales a
    token's gradient instead of masking it (bf16 or vLLM nodes)"""
    """clipped ratio + truncated IS against the behaviour policy (--no-off-policy-correction: the ablation)"""
    loss_norm: Literal["token", "sequence"] = "token"
    """average the loss over tokens or over sequences"""
    adv_norm: AdvNorm = DEFAULT_ADV_NORM
    """group advantages: 'mean' (reward minus the group mean, Dr. GRPO) or 'mean_std' (also divided by
    the group's std, the original GRPO); docs/learning-notes.md has the measurements behind the default"""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """nucleus sampling threshold: only 1 (off) is accepted, see TOP_P_REFUSED"""
    eval_every: EvalEvery = 10
    eval_prompts: EvalPrompts = 0
    metrics_out: str = ""
    """JSON-lines metrics file, one line per learner step"""
    checkpoint_dir: str = ""
    """where to write checkpoints (default runs/<run id, or train-local-<task>>-<time>/checkpoints; 'none': none)"""
    checkpoint_every: int = Field(0, ge=0, le=10**9)
    """checkpoint period in steps (0: only at the end, and on SIGTERM for the learner)"""
    resume: bool = False
    """continue from the newest checkpoint in --checkpoint-dir"""
    nproc: int = Field(1, ge=1, le=256)
    """learner processes training each step data-parallel (torch.distributed: gloo on cpu, nccl with one
    GPU per rank); this process is rank 0 and alone runs everything else"""

    @field_validator("top_p")
    @classmethod
    def _no_nucleus(cls, v: float) -> float:
        if v < 1.0:
            raise ValueError(TOP_P_REFUSED)
        return v


class TrainLocalConfig(TrainingFields):
    """``echorl train-local``: the learner and actor worker processes on this machine, no network."""

    steps: Steps = 400
    staleness: Staleness = 0
    eval_every: EvalEvery = 25
    actors: int = Field(3, ge=1, le=256)
    """actor worker processes"""
    actor_delay: float = Field(0.2, ge=0.0, le=3600.0)
    """seconds before a published version is visible to actors"""
    lease_prompts: int = Field(4, ge=1, le=limits.MAX_PROMPTS_PER_LEASE)
    """prompts per lease"""
    lease_timeout_s: Annotated[float, Flag("--lease-timeout")] = Field(120.0, gt=0.0, le=86_400.0)
    """seconds before an actor's unanswered lease is re-queued (a late answer is dropped): longer than
    a lease takes, or a slow model on a busy CPU never gets a batch through"""
    max_inflight: int = Field(0, ge=0, le=10**6)
    """prompts leased or buffered at once (0: the staleness rule's B·max(1, S - lag), rl/staleness.py)"""
    work_dir: str = ""
    """scratch directory for published weights (default: a temp dir)"""
    quiet: bool = False
    """no progress bar"""
