"""A scored batch on the wire: what the rollout ranks send the trainer for one step, in two parts.

    head   JSON, O(rows): the batch number, the weight version of every row's tokens, the prompts' dataset rows,
           response lengths, finish reasons, scores, the reward and dynamic-sampling metrics, the rollout loader's
           position after the batch's prompts, the rollout's timings. Rollout rank 0 sends it to trainer rank 0,
           which broadcasts it to the trainer's ranks: every rank needs every row's lengths and scores (the row-shard
           plan and the group advantages read them), nothing per token.
    body   the per-token part, as tensors: tokens (int32), rollout log-probs (float32), with multi-turn each token's
           code (uint8: the model's, a tool's, a user's; engine/agent/loop.py) and, with routing replay (R3), every
           row's routed experts (engine/rollout/routing_record.py: [tokens, MoE layers, k] as recorded, moved as
           bytes). Every rollout rank keeps it (`RowBody`); a trainer rank asks one rollout rank for the rows it
           trains (engine/async_rollout/rows.py) and receives exactly those (`RowBody.pack(rows)`, `unpack`).

The sizes follow from the head alone (`body_bytes`), so a body travels as one buffer with nothing around it. JSON
keeps floats exactly (Python writes the shortest repr that reads back to the same double) and nothing is pickled.
`to_bytes` / `from_bytes` is the whole batch in one buffer (head, then every row's body): what a checkpoint keeps of
the batches in its queue.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from tripod.engine.async_rollout.bridge import recv, send

# per response token: int32 token + float32 rollout log-prob (+ one uint8 code with multi-turn)
TOKEN_BYTES = 8


@dataclass
class ScoredBatch:
    """The rollout of trainer step `batch`: n responses per prompt, prompt-major, with their scores. On a trainer rank
    the rows it did not receive are None in `responses`, `log_probs`, `token_codes` and `routed_experts`."""
    batch: int
    versions: list[list[list[int]]]  # per row: [[first token, weight version], ...] (one segment unless partial)
    prompt_indices: list[int]      # per prompt: its row in the training set (PromptDataset.batch)
    responses: list
    log_probs: list                # float32 per row, as long as its response
    finish_reasons: list[str]
    scores: list[float]
    rewards: list[float]
    penalties: list[float]
    metrics: dict[str, float] = field(default_factory=dict)
    loader_state: dict = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    run: int = 0  # which start of the rollout made it (a divergence-guard rollback starts it again)
    routed_experts: list | None = None  # R3: per row [prompt + response tokens, layers, k]
    token_codes: list | None = None  # multi-turn: per row, who wrote each response token (uint8)
    lengths: list[int] | None = None  # every row's response length (set where rows are missing)

    def head(self, attached: bool = False) -> dict:
        body = ("responses", "log_probs", "routed_experts", "token_codes", "lengths")
        head = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in body}
        head["lengths"] = [len(r) for r in self.responses]
        head["coded"] = self.token_codes is not None
        routed = self.routed_experts
        head["routed"] = None if routed is None else {  # per row: its token count; every row: [layers, k], dtype
            "lens": [r.shape[0] for r in routed], "tail": list(routed[0].shape[1:]) if routed else [0, 0],
            "dtype": str(routed[0].dtype if routed else torch.uint8).removeprefix("torch.")}
        head["attached"] = attached
        return head

    def body(self) -> "RowBody":
        return RowBody.of(self)

    def to_wire(self) -> tuple[torch.Tensor, "RowBody"]:
        """(the head's bytes, the body every rollout rank keeps)."""
        return head_bytes(self.head()), self.body()

    def to_bytes(self) -> torch.Tensor:
        """The whole batch in one buffer: the head, then every row's body."""
        body = self.body()
        return torch.cat([head_bytes(self.head(attached=True)), body.pack(range(len(self.responses)))])

    @staticmethod
    def from_bytes(buf: torch.Tensor) -> "ScoredBatch":
        head, offset = parse_head(buf)
        rows = range(len(head["lengths"]))
        return unpack(head, buf[offset:], rows)


def head_bytes(head: dict) -> torch.Tensor:
    raw = json.dumps(head).encode()
    return torch.cat([torch.tensor([len(raw)], dtype=torch.int64).view(torch.uint8),
                      torch.frombuffer(bytearray(raw), dtype=torch.uint8)])


def parse_head(buf: torch.Tensor) -> tuple[dict, int]:
    """(the head, where the attached body starts in `buf`)."""
    n = int(buf[:8].clone().view(torch.int64))
    return json.loads(bytes(buf[8: 8 + n].numpy().tobytes()).decode()), 8 + n


def _routed_row_bytes(head: dict) -> list[int]:
    routed = head["routed"]
    if routed is None:
        return [0] * len(head["lengths"])
    layers, k = routed["tail"]
    item = torch.empty((), dtype=getattr(torch, routed["dtype"])).element_size()
    return [t * layers * k * item for t in routed["lens"]]


def body_bytes(head: dict, rows) -> int:
    """The bytes of `rows`' body (what `RowBody.pack(rows)` makes), from the head alone."""
    lengths, experts = head["lengths"], _routed_row_bytes(head)
    per_token = TOKEN_BYTES + (1 if head["coded"] else 0)
    return sum(lengths[g] * per_token + experts[g] for g in rows)


@dataclass
class RowBody:
    """Every row's per-token data as flat tensors with row offsets: `pack(rows)` is the body of those rows (tokens,
    log-probs, codes, experts, each segment the rows in the given order), sliced, never turned into Python lists."""
    tokens: torch.Tensor       # int32
    log_probs: torch.Tensor    # float32
    codes: torch.Tensor | None  # uint8
    experts: torch.Tensor | None  # uint8 (the records' bytes)
    token_offsets: list[int]
    expert_offsets: list[int]

    @staticmethod
    def of(batch: ScoredBatch) -> "RowBody":
        lengths = [len(r) for r in batch.responses]
        tokens = torch.cat([torch.as_tensor(r, dtype=torch.int32).reshape(-1) for r in batch.responses]) \
            if batch.responses else torch.zeros(0, dtype=torch.int32)
        logp = torch.cat([lp.detach().float().reshape(-1).cpu() for lp in batch.log_probs]) if batch.log_probs \
            else torch.zeros(0)
        if logp.numel() != tokens.numel():
            raise ValueError(f"batch {batch.batch}: {tokens.numel()} tokens but {logp.numel()} rollout log-probs")
        codes = None
        if batch.token_codes is not None:
            codes = torch.cat([torch.as_tensor(c, dtype=torch.uint8).reshape(-1) for c in batch.token_codes]) \
                if batch.token_codes else torch.zeros(0, dtype=torch.uint8)
            if codes.numel() != tokens.numel():
                raise ValueError(f"batch {batch.batch}: {tokens.numel()} tokens but {codes.numel()} token codes")
        experts, expert_lens = None, [0] * len(lengths)
        if batch.routed_experts is not None:
            parts = [r.contiguous().cpu().view(torch.uint8).reshape(-1) for r in batch.routed_experts]
            experts = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)
            expert_lens = [p.numel() for p in parts]
        return RowBody(tokens, logp, codes, experts, _offsets(lengths), _offsets(expert_lens))

    def pack(self, rows) -> torch.Tensor:
        def take(flat: torch.Tensor, off: list[int]) -> torch.Tensor:
            if not len(rows):
                return flat[:0].view(torch.uint8)
            return torch.cat([flat[off[g]: off[g + 1]] for g in rows]).contiguous().view(torch.uint8)
        parts = [take(self.tokens, self.token_offsets), take(self.log_probs, self.token_offsets)]
        if self.codes is not None:
            parts.append(take(self.codes, self.token_offsets))
        if self.experts is not None:
            parts.append(take(self.experts, self.expert_offsets))
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)


def _offsets(lengths: list[int]) -> list[int]:
    out = [0]
    for k in lengths:
        out.append(out[-1] + int(k))
    return out


def unpack(head: dict, body: torch.Tensor, rows) -> ScoredBatch:
    """The batch of a head and the body of `rows` (global row ids, in the body's order); the other rows are None.
    Responses become lists only here, for the rows received (the PPO batch's layout reads lists)."""
    head = dict(head)
    lengths, routed, coded = head.pop("lengths"), head.pop("routed"), head.pop("coded")
    head.pop("attached", None)
    rows = list(rows)
    mine = [lengths[g] for g in rows]
    total = sum(mine)
    expected = body_bytes({"lengths": lengths, "routed": routed, "coded": coded}, rows)
    if body.numel() != expected:
        raise RuntimeError(f"batch {head['batch']}: received {body.numel()} body bytes for {len(rows)} rows, the head "
                           f"says {expected}")
    cut = [4 * total, 4 * total, total if coded else 0]
    segments = list(body.split(cut + [body.numel() - sum(cut)]))
    tokens = segments[0].clone().view(torch.int32)
    logp = segments[1].clone().view(torch.float32)
    size = len(lengths)
    responses: list = [None] * size
    log_probs: list = [None] * size
    codes: list | None = [None] * size if coded else None
    for g, t, lp in zip(rows, tokens.split(mine), logp.split(mine)):
        responses[g], log_probs[g] = t.tolist(), lp
    if coded:
        for g, c in zip(rows, segments[2].clone().split(mine)):
            codes[g] = c
    experts = None
    if routed is not None:
        layers, k = routed["tail"]
        experts = [None] * size
        dtype = getattr(torch, routed["dtype"])
        counts = [routed["lens"][g] for g in rows]
        if rows:
            ids = segments[3].clone().view(dtype).view(-1, layers, k)
            for g, e in zip(rows, ids.split(counts)):
                experts[g] = e
    return ScoredBatch(responses=responses, log_probs=log_probs, routed_experts=experts, token_codes=codes,
                       lengths=lengths, **head)


def send_batch(group, buf: torch.Tensor, dst: int) -> tuple[list, torch.Tensor]:
    """Post the sends of a head (or a whole batch's) buffer; returns (the works, the size tensor): keep both and `buf`
    alive until the works are done."""
    size = torch.tensor([buf.numel()], dtype=torch.int64)
    return [send(group, size, dst, wait=False), send(group, buf, dst, wait=False)], size


def send_end(group, dst: int) -> None:
    """No batch follows (the rollout ranks are done)."""
    send(group, torch.tensor([-1], dtype=torch.int64), dst)


def recv_batch(group, src: int) -> torch.Tensor | None:
    """The next head's (or batch's) bytes, or None at the end of the stream."""
    size = int(recv(group, torch.zeros(1, dtype=torch.int64), src))
    return None if size < 0 else recv(group, torch.empty(size, dtype=torch.uint8), src)
