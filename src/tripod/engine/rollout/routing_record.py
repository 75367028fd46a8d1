"""The routed experts of a generation: every prompt and generated token's top-k expert ids per MoE layer (R3).

The embedded engine's MoE decoder appends each MoE layer's choice ([rows, slots, k], in layer order) to its
`routing_log` when one is set (engine/rollout/moe_decoder.py); `RoutingRecorder` files them by batch row and KV-cache
slot as generation runs (the prefill, each decode step, the re-prefill after a weight switch) and hands each row's
ids back in batch order: the real prompt tokens, then the response tokens. A response's last token is never fed back
to the model, so it has no record: it and anything unrecorded carry the no-record mark `num_experts`
(parallel/router_replay.py, which replays them in the trainer). `gather_rollout_routing` brings every replica's rows
to every rank and `attach_rollout_routing` lays them out as the step's batch rows (the trainer's R3 and the
`moe/routing_mismatch_frac` metric).

Multi-turn rows (engine/agent/loop.py) are joined from one record per turn by `join_turn`: a position's record is
the routing of the first forward that fed it, i.e. of the generate call whose log-probs depended on it. Turn t's call
first feeds the previous turn's last model token, the tool / user tokens after it and turn t's own model tokens but
its last; the positions before were fed by earlier calls (turn t's prefill recomputes them: those records are
dropped), and the row's last token is never fed (no-record mark).
"""
from __future__ import annotations

import torch

from tripod.parallel.moe_arch import MoEArch
from tripod.parallel.router_replay import routing_dtype


def topk_ids(routing_map: torch.Tensor, k: int) -> torch.Tensor:
    """[T, k] expert ids (ascending) of a [T, E] boolean routing map with k experts per token."""
    return routing_map.to(torch.int8).topk(k, dim=-1, sorted=False).indices.sort(-1).values


class RoutingRecorder:
    """Per-row, per-slot expert ids of one `generate` call on a decoder with a `routing_log`."""

    def __init__(self, decoder, moe: MoEArch, rows: int, slots: int) -> None:
        self.decoder, self.moe = decoder, moe
        self.layers = sum(moe.layer_is_moe)
        self.ids = torch.full((rows, slots, self.layers, moe.topk), moe.num_experts, dtype=routing_dtype(
            moe.num_experts))
        decoder.routing_log = []

    def _take(self) -> torch.Tensor:
        """The log of the forward just run as [rows, slots, L, k] (and an empty log for the next)."""
        log, self.decoder.routing_log = self.decoder.routing_log, []
        if len(log) != self.layers:
            raise RuntimeError(f"routing record: {len(log)} MoE layers logged, the model has {self.layers}")
        return torch.stack(log, dim=2).to("cpu", self.ids.dtype)

    def prefill_ran(self, samples: torch.Tensor) -> None:
        """The decoder just prefilled the prompts (one row each); row r is a sample of prompt `samples[r]`."""
        ids = self._take()
        self.ids[:, : ids.shape[1]] = ids[samples.cpu()]

    def forward_ran(self, rows: torch.Tensor, start: int) -> None:
        """The decoder just ran slots start.. of the batch entries whose original rows are `rows`."""
        ids = self._take()
        self.ids[rows.cpu(), start:start + ids.shape[1]] = ids

    def close(self) -> None:
        self.decoder.routing_log = None

    def per_row(self, prompt_mask: torch.Tensor, lengths: torch.Tensor, prompt_of_row: torch.Tensor
                ) -> list[torch.Tensor]:
        """Each row's [prompt_len + response_len, L, k]: its real prompt tokens' ids then its response tokens'
        (the last response token marked as unrecorded). `prompt_mask` [prompts, P] (left padded)."""
        width = prompt_mask.shape[1]
        out = []
        for row, length in enumerate(lengths.tolist()):
            real = prompt_mask[int(prompt_of_row[row])].cpu()
            ids = torch.cat([self.ids[row, :width][real], self.ids[row, width:width + length]])
            if length:
                ids[-1] = self.moe.num_experts
            out.append(ids)
        return out


def join_turn(joined: torch.Tensor | None, turn: torch.Tensor, context: int, generated: int, kept: int
              ) -> torch.Tensor:
    """A multi-turn row's record after one more model turn (see the module docstring).

    `joined`: the row's record after its previous model turn (None before its first): [context up to that turn's last
    model token, L, k], that token marked unrecorded; the tool / user tokens after it have no entry yet. `turn`: this
    turn's generate record of the row, [context + generated, L, k] (the context, the whole row so far, prefilled as the
    prompt, then the generated tokens, the last marked); `kept`: the generated tokens the row keeps (fewer when the
    response budget cuts the turn). Returns [context + kept, L, k]: `joined` up to its last (marked) position, this
    turn's record from there on, the last kept token marked."""
    if turn.shape[0] != context + generated or not 0 < kept <= generated:
        raise ValueError(f"routing record of a turn: {turn.shape[0]} positions, expected the context ({context}) plus "
                         f"the {generated} generated tokens (keeping {kept})")
    mark = turn[-1]  # every generate record marks its last token (no record): the mark, num_experts
    if bool((mark != mark.flatten()[0]).any()) or bool((turn[:-1] > mark.flatten()[0]).any()):
        raise ValueError("routing record of a turn: its last token does not carry the no-record mark")
    fed = 0
    if joined is not None:
        fed = joined.shape[0] - 1
        if joined.shape[1:] != turn.shape[1:] or joined.dtype != turn.dtype or fed >= context:
            raise ValueError(f"routing record of a turn: {tuple(turn.shape)} {turn.dtype} does not extend the row's "
                             f"{tuple(joined.shape)} {joined.dtype} (context {context})")
    out = torch.cat([turn[:0] if joined is None else joined[:fed], turn[fed: context + kept]])
    out[-1] = mark
    return out


def from_sglang(value, tokens: int, moe: MoEArch) -> torch.Tensor:
    """One SGLang request's routed experts in tripod's per-row layout [tokens, MoE layers, k] (`tokens`: its prompt
    plus response tokens; ascending ids, the last token marked unrecorded as the embedded engine's record).

    SGLang (server arg enable_return_routed_experts, request return_routed_experts=True) returns them in
    meta_info["routed_experts"]: RoutedExpertsCapturer.get_routed_experts (python/sglang/srt/layers/moe/
    routed_experts_capturer.py) reads its int32 host buffer [KV slots, num_hidden_layers, num_experts_per_tok] at the
    request's first seqlen - 1 slots (every token but the last, which never went back through the model), and the
    detokenizer sends those bytes base64-encoded (extract_routed_experts_from_meta_info, same file); every hidden
    layer has a column there (a dense layer's is never written), shared experts none. A decoded array is taken too."""
    import base64

    import numpy as np

    if isinstance(value, str):
        raw = torch.from_numpy(np.frombuffer(base64.b64decode(value), dtype=np.int32).copy())
    else:
        raw = torch.as_tensor(np.array(value, dtype=np.int32))
    hidden, k = len(moe.layer_is_moe), moe.topk
    if raw.numel() != max(tokens - 1, 0) * hidden * k:
        raise RuntimeError(f"sglang routed_experts: {raw.numel()} ids, expected (prompt + response - 1 = "
                           f"{tokens - 1}) tokens x {hidden} layers x top-{k} (is the server's "
                           "enable_return_routed_experts on, and the model's config the one tripod read?)")
    moe_layers = torch.tensor([i for i, m in enumerate(moe.layer_is_moe) if m], dtype=torch.long)
    out = torch.full((tokens, len(moe_layers), k), moe.num_experts, dtype=routing_dtype(moe.num_experts))
    if tokens > 1:
        out[: tokens - 1] = raw.view(tokens - 1, hidden, k)[:, moe_layers].sort(-1).values.to(out.dtype)
    return out


def record_bytes(rows: list[torch.Tensor]) -> int:
    """Bytes the recorded ids take (what replay adds to a step's batch before padding)."""
    return sum(r.numel() * r.element_size() for r in rows)


def batch_tensor(rows: list[torch.Tensor], seq: int, num_experts: int) -> torch.Tensor:
    """[N, seq, L, k] of per-row ids (prompt then response tokens, as `build_ppo_batch` lays the row out), the
    no-record mark past each row's tokens."""
    if not rows:
        raise ValueError("no routed-expert rows")
    layers, k = rows[0].shape[1:]
    out = torch.full((len(rows), seq, layers, k), num_experts, dtype=rows[0].dtype)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r[:seq]
    return out


def gather_rollout_routing(local: list[torch.Tensor] | None, replica_ranks: list[list[int]], moe: MoEArch
                           ) -> list[torch.Tensor]:
    """Every rollout row's record in global row order (replica after replica, as the rollout exchange orders the
    rows), on every rank: each replica's rows (`local`, the same on its ranks) all-gathered over the world as raw
    bytes. Collective over the world."""
    import torch.distributed as dist

    from tripod.runtime.device import current_device

    dev, world = current_device(), dist.get_world_size()
    layers, k, dt = sum(moe.layer_is_moe), moe.topk, routing_dtype(moe.num_experts)
    width = layers * k * torch.tensor([], dtype=dt).element_size()  # bytes per token
    local = local or []
    flat = torch.cat(local).contiguous() if local else torch.empty(0, layers, k, dtype=dt)
    counts = torch.tensor([len(local), flat.shape[0]], dtype=torch.int64)
    every = [torch.empty(2, dtype=torch.int64, device=dev) for _ in range(world)]
    dist.all_gather(every, counts.to(dev))
    every = [c.cpu() for c in every]
    max_rows, max_tokens = max(int(c[0]) for c in every), max(int(c[1]) for c in every)
    lens = torch.zeros(max(max_rows, 1), dtype=torch.int64)
    lens[: len(local)] = torch.tensor([r.shape[0] for r in local], dtype=torch.int64)
    data = torch.zeros(max(max_tokens, 1) * width, dtype=torch.uint8)
    data[: flat.numel() * flat.element_size()] = flat.view(torch.uint8).reshape(-1)
    all_lens = [torch.empty_like(lens, device=dev) for _ in range(world)]
    all_data = [torch.empty_like(data, device=dev) for _ in range(world)]
    dist.all_gather(all_lens, lens.to(dev))
    dist.all_gather(all_data, data.to(dev))
    rows: list[torch.Tensor] = []
    for ranks in replica_ranks:
        r = int(ranks[0])
        n, tokens = int(every[r][0]), int(every[r][1])
        ids = all_data[r][: tokens * width].cpu().view(dt).view(tokens, layers, k)
        rows += list(ids.split(all_lens[r][:n].cpu().tolist()))
    return rows


def attach_rollout_routing(batch, every_row: list[torch.Tensor], rows: list[int] | range, moe: MoEArch) -> int:
    """The batch's routed_experts (and the rollout's copy the mismatch metric reads: the same tensor) from every
    rollout row's record; `rows`: the global rows the batch holds, in its order. Returns the bytes added."""
    from tripod.parallel.router_replay import ROLLOUT_ROUTED_EXPERTS_KEY, ROUTED_EXPERTS_KEY

    ids = batch_tensor([every_row[g] for g in rows], batch["input_ids"].shape[1], moe.num_experts)
    ids = ids.to(batch["input_ids"].device)
    batch[ROUTED_EXPERTS_KEY] = ids
    batch.tensors[ROLLOUT_ROUTED_EXPERTS_KEY] = ids
    return ids.numel() * ids.element_size()
