"""The PPO step's batch: prompts + responses laid out for Megatron, and how it is cut for DP and micro-batches.

Row i holds `prompt_i + response_i` right-padded to S (so RoPE positions are 0..len-1 as in generation and a
plain causal mask is enough: real tokens never attend to the padding after them). The logits / hidden state that
predict response token t of row i sit at position `prompt_lens[i] + t - 1`; `response_positions()` gives that
index. Every tensor with a leading row dimension lives in `tensors`, so slicing for DP ranks, mini-batches and
micro-batches is one `select`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tripod.engine.algorithms.masked import masked_mean as _masked_mean


@dataclass
class RowLengths:
    """Every row's prompt length, counted response tokens (its response mask's sum), tokens (its attention mask's
    sum) and prompt id (`index`), [N] int64 each, on the CPU: what the row assignment, the token-budget partition,
    the loss normalisers and the length metrics read of rows a rank may not hold."""
    prompt_lens: torch.Tensor
    response_lens: torch.Tensor
    seq_lens: torch.Tensor
    index: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.index.shape[0])

    @staticmethod
    def of_rollout(prompt_lens: list[int], response_lens: list[int], index: list[int]) -> "RowLengths":
        """The lengths of the batch `build_ppo_batch` lays out of these rows (nothing masked yet)."""
        p, r = torch.tensor(prompt_lens, dtype=torch.int64), torch.tensor(response_lens, dtype=torch.int64)
        return RowLengths(p, r, p + r, torch.tensor(index, dtype=torch.int64))

    @staticmethod
    def of(batch: "PPOBatch | RowLengths") -> "RowLengths":
        if isinstance(batch, RowLengths):
            return batch
        cpu = lambda t: t.detach().to("cpu", torch.int64)  # noqa: E731
        return RowLengths(cpu(batch["prompt_lens"]), cpu(batch["response_mask"].sum(-1)),
                          cpu(batch["attention_mask"].sum(-1)), cpu(batch["index"]))

    def select(self, rows: torch.Tensor | list[int] | slice) -> "RowLengths":
        idx = rows if isinstance(rows, slice) else torch.as_tensor(rows, dtype=torch.long).cpu()
        return RowLengths(self.prompt_lens[idx], self.response_lens[idx], self.seq_lens[idx], self.index[idx])


@dataclass
class BatchShard:
    """The rows a sharded batch holds (`rows`: their ids among the `lengths.size` rows `lengths` describes, ascending;
    the batch holds them in that order): the step's rows, or a mini-batch's (ppo_workers._sharded_mini_batch)."""
    rows: list[int]
    lengths: RowLengths

    def __post_init__(self) -> None:
        self._local = {g: i for i, g in enumerate(self.rows)}

    def local(self, rows: list[int]) -> list[int]:
        """Row ids -> this batch's row positions (KeyError on a row it does not hold)."""
        return [self._local[int(g)] for g in rows]

    def __contains__(self, row: int) -> bool:
        return int(row) in self._local


@dataclass
class PPOBatch:
    tensors: dict[str, torch.Tensor]              # every entry has N rows
    meta: dict[str, list] = field(default_factory=dict)  # per-row python values (data_source, ground truth, ...)
    packed: Any = None  # a micro-batch's shared-prompt layout (engine/workers/packing.py), set by the worker's run()
    shard: BatchShard | None = None  # set when the batch holds only this DP rank's rows (see the module docstring)

    @property
    def size(self) -> int:
        return self.tensors["input_ids"].shape[0]

    @property
    def recomputed_old_log_probs(self) -> bool:
        """Whether these rows carry old log-probs: recomputed by the trainer, or the rollout's under
        algorithm.rollout_correction.bypass_mode. The trainer skips the recompute when the actor update is exactly
        on-policy (engine/step_plan.py, old_log_probs="update"); the update then takes its own forward's, detached."""
        return "old_log_probs" in self.tensors

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        if value.shape[0] != self.size:
            raise ValueError(f"batch[{key!r}] has {value.shape[0]} rows, the batch has {self.size}")
        self.tensors[key] = value

    def select(self, rows: torch.Tensor | list[int] | slice) -> "PPOBatch":
        device = self.tensors["input_ids"].device
        if isinstance(rows, slice):
            idx = torch.arange(self.size, device=device)[rows]
        else:
            idx = torch.as_tensor(rows, dtype=torch.long).to(device)
        meta = {k: [v[i] for i in idx.tolist()] for k, v in self.meta.items()} if self.meta else {}
        return PPOBatch({k: v[idx] for k, v in self.tensors.items()}, meta)

    def to(self, device: torch.device | str) -> "PPOBatch":
        """The batch with every tensor on `device` (the device runtime/device.py chose)."""
        return PPOBatch({k: v.to(device, non_blocking=True) for k, v in self.tensors.items()}, self.meta,
                        shard=self.shard)

    @property
    def lengths(self) -> RowLengths:
        """Every row's lengths and prompt id: the whole step's for a sharded batch, else this batch's own."""
        return self.shard.lengths if self.shard is not None else RowLengths.of(self)

    def trimmed(self) -> "PPOBatch":
        """Drop sequence columns that are padding in every row (less compute per micro-batch)."""
        s = int(self.tensors["attention_mask"].sum(-1).max().item())
        out = dict(self.tensors)
        out["input_ids"] = out["input_ids"][:, :s]
        out["attention_mask"] = out["attention_mask"][:, :s]
        return PPOBatch(out, self.meta)

    def response_positions(self) -> torch.Tensor:
        """[N, R] index of the position whose output predicts each response token (clamped inside S)."""
        r = self.tensors["responses"].shape[1]
        s = self.tensors["input_ids"].shape[1]
        lens = self.tensors["prompt_lens"]
        pos = lens[:, None] + torch.arange(r, device=lens.device)[None, :] - 1
        return pos.clamp(0, s - 1)


def build_ppo_batch(prompts: list[list[int]], responses: list[list[int]], response_length: int,
                    pad_token_id: int, index: list[int], rollout_log_probs: list[torch.Tensor] | None = None,
                    finish_reasons: list[str] | None = None, seq_len: int | None = None,
                    response_masks: list[torch.Tensor] | None = None) -> PPOBatch:
    """Lay out `prompts[i] + responses[i]` right-padded; responses padded to `response_length` columns.
    `rollout_log_probs[i]` (the rollout engine's log-prob of each token of responses[i]) becomes row i of
    "rollout_log_probs" [N, response_length], aligned with "responses" and 0 past each length; `finish_reasons`
    go to meta["finish_reasons"]. `seq_len`: pad the rows to at least this many columns (a sharded batch keeps the
    whole batch's width, so its rows are laid out as in the whole batch). `response_masks[i]` ([len(responses[i])],
    multi-turn rows): row i's response mask, 0 on the tool and user tokens inside the response (every consumer reads
    the mask; the layout's response length is parallel/response_span.py's)."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    if rollout_log_probs is not None and len(rollout_log_probs) != len(responses):
        raise ValueError(f"{len(rollout_log_probs)} rows of rollout log-probs for {len(responses)} responses")
    n = len(prompts)
    seq = max([len(p) + max(len(r), 1) for p, r in zip(prompts, responses)] + [seq_len or 0])
    input_ids = torch.full((n, seq), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((n, seq), dtype=torch.long)
    resp = torch.full((n, response_length), pad_token_id, dtype=torch.long)
    resp_mask = torch.zeros((n, response_length), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if len(r) > response_length:
            raise ValueError(f"response {i} has {len(r)} tokens > response_length={response_length}")
        ids = list(p) + list(r)
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention_mask[i, : len(ids)] = 1
        if r:
            resp[i, : len(r)] = torch.tensor(r)
            resp_mask[i, : len(r)] = 1.0 if response_masks is None else torch.as_tensor(response_masks[i]).float()
    tensors = dict(input_ids=input_ids, attention_mask=attention_mask, responses=resp, response_mask=resp_mask,
                   prompt_lens=torch.tensor([len(p) for p in prompts]), index=torch.tensor(index))
    if rollout_log_probs is not None:
        logp = torch.zeros((n, response_length), dtype=torch.float32)
        for i, (r, lp) in enumerate(zip(responses, rollout_log_probs)):
            if len(lp) != len(r):
                raise ValueError(f"response {i} has {len(r)} tokens but {len(lp)} rollout log-probs")
            logp[i, : len(r)] = torch.as_tensor(lp, dtype=torch.float32)
        tensors["rollout_log_probs"] = logp
    meta = {"finish_reasons": list(finish_reasons)} if finish_reasons is not None else {}
    return PPOBatch(tensors, meta)


def split_rows(n: int, parts: int) -> list[slice]:
    """`parts` equal contiguous slices of n rows (n must divide; validated up front by the config)."""
    if n % parts:
        raise ValueError(f"cannot split {n} rows into {parts} equal parts")
    k = n // parts
    return [slice(i * k, (i + 1) * k) for i in range(parts)]


def batch_metrics(batch: PPOBatch, scores: list[float], shards=None) -> dict[str, float]:
    """What a PPO step's batch looked like (verl's names): scores, advantages, returns, response and prompt lengths,
    and with a critic its values and explained variance. `shards` (engine/workers/row_shards.py's RowShards): the
    per-token results are this rank's rows only, their statistics reduce over the DP ranks."""
    mask = batch["response_mask"]
    masked_mean = _masked_mean if shards is None else shards.masked_mean
    row_mean = (lambda x: x.mean()) if shards is None else shards.row_mean  # noqa: E731
    # generated lengths from the layout, not the loss mask (rollout correction's rejection may have zeroed rows); a
    # sharded batch's from every row's lengths
    if batch.shard is not None:
        every = batch.shard.lengths
        lengths, prompt_lens = (every.seq_lens - every.prompt_lens).float(), every.prompt_lens.float()
    else:
        lengths = (batch["attention_mask"].sum(-1) - batch["prompt_lens"].to(batch["attention_mask"].device)).float()
        prompt_lens = batch["prompt_lens"].float()
    out = {"critic/score/mean": float(sum(scores) / len(scores)), "critic/score/max": float(max(scores)),
           "critic/score/min": float(min(scores)),
           "critic/advantages/mean": float(masked_mean(batch["advantages"], mask)),
           "critic/returns/mean": float(masked_mean(batch["returns"], mask)),
           # rows whose advantage is not 0 on every token: 0 when every GRPO group scored alike (an update of nothing)
           "critic/advantages/nonzero_frac": float(row_mean(((batch["advantages"] * mask).abs().sum(-1) > 0).float())),
           "response_length/mean": float(lengths.mean()),
           "response_length/clip_ratio": float((lengths >= mask.shape[1]).float().mean()),
           "prompt_length/mean": float(prompt_lens.mean())}
    if "values" in batch.tensors:
        v, r = batch["values"], batch["returns"]
        out["critic/values/mean"] = float(masked_mean(v, mask))
        var_r = masked_mean((r - masked_mean(r, mask)) ** 2, mask)
        resid = r - v
        var_res = masked_mean((resid - masked_mean(resid, mask)) ** 2, mask)
        out["critic/vf_explained_var"] = float(1 - var_res / (var_r + 1e-8))
    return out
