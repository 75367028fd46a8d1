"""`distillation.*`: on-policy distillation from a frozen teacher, verl 0.9.1's keys and semantics.

The teacher (one megatron model, its own size and layout, the student's tokenizer) scores the student's own rollouts:
per-token log-probs of the sampled tokens (the estimator modes k1 / kl, abs, k2 / mse, k3 / low_var_kl) or its top-k
log-probs at every response position (forward_kl_topk). The loss (engine/algorithms/distillation.py) enters the
actor's loss beside the task's policy loss (`use_task_rewards`) or replaces it; `use_policy_gradient` turns the
per-token loss into an advantage (-loss, detached) for a clipped policy-gradient loss instead of backpropagating it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from tripod.engine.config.megatron_args import MegatronConfig

ESTIMATOR_MODES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")  # verl: use_estimator=True
TOPK_MODES = ("forward_kl_topk",)  # verl: use_topk=True
LOSS_MODES = ESTIMATOR_MODES + TOPK_MODES


@dataclass
class DistillationLossConfig:
    loss_mode: str = "k3"
    """Per-token distillation loss: an estimator of KL(student || teacher) on the sampled token (k1 / kl, abs,
    k2 / mse, k3 / low_var_kl: verl's kl_penalty) or forward_kl_topk, sum over the teacher's top-k tokens of
    q (log q - log p). verl: distillation.distillation_loss.loss_mode."""
    topk: Optional[int] = 32
    """k of forward_kl_topk: the teacher's k most likely tokens per position. verl: distillation_loss.topk."""
    use_task_rewards: bool = True
    """Keep the task's policy loss (with its entropy and KL-loss terms) and add distillation_loss_coef x the
    distillation loss; false: the distillation loss alone (coefficient 1). verl: distillation_loss.use_task_rewards."""
    distillation_loss_coef: float = 1.0
    """Weight of the distillation loss when use_task_rewards. verl: distillation_loss.distillation_loss_coef."""
    loss_max_clamp: Optional[float] = None
    """Clamp every per-token distillation loss to [-x, x] before aggregation (after distillation/loss_min|max are
    taken); null: no clamp. verl: distillation_loss.loss_max_clamp."""
    log_prob_min_clamp: Optional[float] = None
    """forward_kl_topk: clamp teacher and student log-probs from below at this value (a clamped student entry gets
    no gradient); null: no clamp. verl: distillation_loss.log_prob_min_clamp."""
    use_policy_gradient: bool = False
    """The negated per-token loss (detached) becomes the advantage of a clipped policy-gradient loss (Thinking
    Machines' on-policy distillation; k1 recommended) instead of being backpropagated directly.
    verl: distillation_loss.use_policy_gradient."""
    policy_loss_mode: str = "vanilla"
    """Policy loss of use_policy_gradient; verl 0.9.1 supports vanilla only. verl: distillation_loss.policy_loss_mode."""
    clip_ratio: float = 0.2
    """PPO clip range of use_policy_gradient where clip_ratio_low / _high are null. verl: distillation_loss.clip_ratio."""
    clip_ratio_low: Optional[float] = 0.2
    """Lower clip range of use_policy_gradient. verl: distillation_loss.clip_ratio_low."""
    clip_ratio_high: Optional[float] = 0.2
    """Upper clip range of use_policy_gradient. verl: distillation_loss.clip_ratio_high."""

    @property
    def use_topk(self) -> bool:
        return self.loss_mode in TOPK_MODES

    def clip_range(self) -> tuple[float, float]:
        """(low, high) as verl's vanilla loss reads them: each falls back to clip_ratio when null."""
        low = self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low
        high = self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high
        return low, high

    def check(self, key: str = "distillation.distillation_loss") -> list[str]:
        e = []
        if self.loss_mode not in LOSS_MODES:
            e.append(f"{key}.loss_mode={self.loss_mode!r} is not a distillation loss; choose one of {list(LOSS_MODES)}")
        if self.use_topk and (self.topk is None or self.topk < 1):
            e.append(f"{key}.topk={self.topk} must be >= 1 for loss_mode={self.loss_mode}")
        if self.policy_loss_mode != "vanilla":
            e.append(f"{key}.policy_loss_mode={self.policy_loss_mode!r}: only vanilla is supported with "
                     "use_policy_gradient (as in verl 0.9.1); set it to vanilla")
        if not self.use_policy_gradient and self.loss_mode in ("k1", "kl"):
            e.append(f"{key}.loss_mode={self.loss_mode} with use_policy_gradient=false: the gradient of k1 does not "
                     "depend on the teacher (verl refuses it too); set use_policy_gradient=true or loss_mode=k3")
        if self.loss_max_clamp is not None and self.loss_max_clamp <= 0:
            e.append(f"{key}.loss_max_clamp={self.loss_max_clamp} must be > 0 (or null)")
        return e


@dataclass
class TeacherModelConfig:
    key: Optional[str] = None
    """Which rows this teacher scores in a multi-teacher run (the value of their distillation.teacher_key column);
    tripod runs one teacher, which scores every row. verl: teacher_models.<name>.key."""
    model_path: Optional[str] = None
    """The teacher: a Hugging Face model directory with the student's tokenizer (any size).
    verl: teacher_models.<name>.model_path."""
    num_replicas: int = 0
    """verl's teacher inference replicas; tripod's teacher runs on the trainer's ranks (its megatron layout below), so
    this is accepted and unused. verl: teacher_models.<name>.num_replicas."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """The teacher's own parallel layout (TP / PP over the trainer's world, DP = the rest), precision and seed;
    independent of the actor's. tripod's (verl serves teachers with vLLM / SGLang: teacher_models.<name>.inference)."""
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    """Rows per micro-batch of the teacher's forward; null: all of a rank's rows at once."""


@dataclass
class DistillationConfig:
    enabled: bool = False
    """On-policy distillation from the teacher below. verl: distillation.enabled."""
    distillation_loss: DistillationLossConfig = field(default_factory=DistillationLossConfig)
    """The loss and how it combines with the task's. verl: distillation.distillation_loss."""
    teacher_models: dict[str, TeacherModelConfig] = field(
        default_factory=lambda: {"teacher_model": TeacherModelConfig()})
    """The teacher, under any name (verl's default entry is teacher_model); tripod runs exactly one.
    verl: distillation.teacher_models."""
    teacher_key: str = "data_source"
    """verl's multi-teacher routing column; read only with several teachers, which tripod refuses.
    verl: distillation.teacher_key."""
    n_gpus_per_node: int = 0
    """verl's teacher resource pool; tripod's teacher shares the trainer's ranks, so it is accepted and unused."""
    nnodes: int = 0
    """verl's teacher resource pool nodes; accepted and unused (see n_gpus_per_node)."""

    def teacher(self) -> tuple[str, TeacherModelConfig]:
        """(name, config) of the one configured teacher: the entry with a model_path (verl drops the default
        teacher_model entry once others are added)."""
        named = [(n, t) for n, t in self.teacher_models.items() if t.model_path]
        return named[0] if named else next(iter(self.teacher_models.items()))

    def check(self, key: str = "distillation") -> list[str]:
        if not self.enabled:
            return []
        e = self.distillation_loss.check(f"{key}.distillation_loss")
        named = [n for n, t in self.teacher_models.items() if t.model_path]
        if len(named) > 1:
            e.append(f"{key}.teacher_models has {len(named)} teachers ({', '.join(named)}): tripod runs one teacher "
                     "for every row; keep one entry with a model_path")
        name, t = self.teacher()
        tkey = f"{key}.teacher_models.{name}"
        if not t.model_path:
            e.append(f"{tkey}.model_path is not set; give the teacher's Hugging Face model directory")
        elif not os.path.isfile(os.path.join(os.path.expanduser(t.model_path), "config.json")):
            e.append(f"{tkey}.model_path={t.model_path} has no config.json; give a Hugging Face model directory")
        micro = t.log_prob_micro_batch_size_per_gpu
        if micro is not None and micro < 1:
            e.append(f"{tkey}.log_prob_micro_batch_size_per_gpu={micro} must be >= 1 (or null)")
        if t.megatron.context_parallel_size > 1:
            e.append(f"{tkey}.megatron.context_parallel_size={t.megatron.context_parallel_size}: the teacher does not "
                     "run context parallel; set it to 1")
        return e + t.megatron.check(f"{tkey}.megatron")


def tokenizer_problem(cfg) -> Optional[str]:
    """One line naming the teacher's model_path when its tokenizer differs from the student's (vocabulary, special
    tokens, or the ids of a probe text), else None. Read from the tokenizer files only: no model is built."""
    dcfg = cfg.distillation
    name, t = dcfg.teacher()
    if not dcfg.enabled or not t.model_path or not cfg.actor_rollout_ref.model.path:
        return None
    from transformers import AutoTokenizer

    student = AutoTokenizer.from_pretrained(cfg.data.tokenizer or cfg.actor_rollout_ref.model.path)
    teacher = AutoTokenizer.from_pretrained(t.model_path)
    probe = "On-policy distillation: 12 + 7 = 19 #### 19\n<|im_start|>user é ü 中文"
    same = (student.get_vocab() == teacher.get_vocab() and student.eos_token_id == teacher.eos_token_id
            and student(probe)["input_ids"] == teacher(probe)["input_ids"])
    if same:
        return None
    return (f"distillation.teacher_models.{name}.model_path={t.model_path}: its tokenizer differs from the student's "
            f"({cfg.data.tokenizer or cfg.actor_rollout_ref.model.path}); the teacher scores the student's token ids, "
            "so give a teacher with the same tokenizer")
