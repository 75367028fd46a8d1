"""A scored batch on the wire: what the rollout ranks send the trainer for one step.

One uint8 buffer: an 8-byte length, a JSON head (everything but the tokens and log-probs: the batch number, the
weight version of every row's tokens, the prompts' dataset rows, response lengths, finish reasons, scores, the
reward and dynamic-sampling metrics, the rollout loader's position after the batch's prompts, the rollout's timings),
then the tokens (int32), the rollout log-probs (float32), with multi-turn each token's code (uint8: the model's, a
tool's, a user's; engine/agent/loop.py) and, with routing replay (R3), every row's routed experts
(engine/rollout/routing_record.py: [tokens, MoE layers, k] uint8 or int16, as recorded). JSON keeps floats exactly (Python writes the shortest
repr that reads back to the same double) and nothing is pickled. `send_batch` / `recv_batch` move it over the data
bridge (size first, then the buffer).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from tripod.engine.async_rollout.bridge import recv, send


@dataclass
class ScoredBatch:
    """The rollout of trainer step `batch`: n responses per prompt, prompt-major, with their scores."""
    batch: int
    versions: list[list[list[int]]]  # per row: [[first token, weight version], ...] (one segment unless partial)
    prompt_indices: list[int]      # per prompt: its row in the training set (PromptDataset.batch)
    responses: list[list[int]]
    log_probs: list[torch.Tensor]  # float32 per row, as long as its response
    finish_reasons: list[str]
    scores: list[float]
    rewards: list[float]
    penalties: list[float]
    metrics: dict[str, float] = field(default_factory=dict)
    loader_state: dict = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    run: int = 0  # which start of the rollout made it (a divergence-guard rollback starts it again)
    routed_experts: list[torch.Tensor] | None = None  # R3: per row [prompt + response tokens, layers, k]
    token_codes: list[torch.Tensor] | None = None  # multi-turn: per row, who wrote each response token (uint8)

    def to_bytes(self) -> torch.Tensor:
        body = ("responses", "log_probs", "routed_experts", "token_codes")
        head = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in body}
        head["lengths"] = [len(r) for r in self.responses]
        head["coded"] = self.token_codes is not None
        routed = self.routed_experts
        head["routed"] = None if routed is None else {  # per row: its token count; every row: [layers, k], dtype
            "lens": [r.shape[0] for r in routed], "tail": list(routed[0].shape[1:]) if routed else [0, 0],
            "dtype": str(routed[0].dtype if routed else torch.uint8).removeprefix("torch.")}
        raw = json.dumps(head).encode()
        tokens = torch.tensor([t for r in self.responses for t in r], dtype=torch.int32)
        logp = torch.cat([lp.detach().float().reshape(-1) for lp in self.log_probs]) if self.log_probs \
            else torch.zeros(0)
        if logp.numel() != tokens.numel():
            raise ValueError(f"batch {self.batch}: {tokens.numel()} tokens but {logp.numel()} rollout log-probs")
        size = torch.tensor([len(raw)], dtype=torch.int64)
        experts = torch.cat([r.contiguous().view(torch.uint8).reshape(-1) for r in routed]) if routed else \
            torch.zeros(0, dtype=torch.uint8)
        codes = torch.cat([torch.as_tensor(c, dtype=torch.uint8).reshape(-1) for c in self.token_codes]) \
            if self.token_codes else torch.zeros(0, dtype=torch.uint8)
        if self.token_codes is not None and codes.numel() != tokens.numel():
            raise ValueError(f"batch {self.batch}: {tokens.numel()} tokens but {codes.numel()} token codes")
        return torch.cat([size.view(torch.uint8), torch.frombuffer(bytearray(raw), dtype=torch.uint8),
                          tokens.view(torch.uint8), logp.view(torch.uint8), codes, experts])

    @staticmethod
    def from_bytes(buf: torch.Tensor) -> "ScoredBatch":
        n = int(buf[:8].clone().view(torch.int64))
        head = json.loads(bytes(buf[8: 8 + n].tolist()).decode())
        lengths, routed, coded = head.pop("lengths"), head.pop("routed"), head.pop("coded")
        total = sum(lengths)
        body = buf[8 + n:].clone()
        codes = list(body[8 * total: 9 * total].split(lengths)) if coded else None
        if coded:  # the expert ids follow the codes
            body = torch.cat([body[: 8 * total], body[9 * total:]])
        tokens = body[: 4 * total].view(torch.int32).tolist()
        logp = body[4 * total: 8 * total].view(torch.float32)
        responses, log_probs, start = [], [], 0
        for k in lengths:
            responses.append(tokens[start: start + k])
            log_probs.append(logp[start: start + k])
            start += k
        experts = None
        if routed is not None:
            layers, k = routed["tail"]
            ids = body[8 * total:].view(getattr(torch, routed["dtype"])).view(-1, layers, k) if routed["lens"] else None
            experts = list(ids.split(routed["lens"])) if ids is not None else []
        return ScoredBatch(responses=responses, log_probs=log_probs, routed_experts=experts, token_codes=codes, **head)


def send_batch(group, buf: torch.Tensor, dst: int) -> tuple[list, torch.Tensor]:
    """Post the sends of a `to_bytes()` buffer; returns (the works, the size tensor): keep both and `buf` alive
    until the works are done."""
    size = torch.tensor([buf.numel()], dtype=torch.int64)
    return [send(group, size, dst, wait=False), send(group, buf, dst, wait=False)], size


def send_end(group, dst: int) -> None:
    """No batch follows (the rollout ranks are done)."""
    send(group, torch.tensor([-1], dtype=torch.int64), dst)


def recv_batch(group, src: int) -> torch.Tensor | None:
    """The next batch's bytes, or None at the end of the stream."""
    size = int(recv(group, torch.zeros(1, dtype=torch.int64), src))
    return None if size < 0 else recv(group, torch.empty(size, dtype=torch.uint8), src)
