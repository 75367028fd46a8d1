"""Multi-turn rollouts with R3 routing replay: the agent loop (engine/agent/loop.py) joins each turn's routing record
into the row's (engine/rollout/routing_record.py `join_turn`).

A tiny Qwen3-MoE (4 experts, top-2, a dense layer) generates on the embedded engine with routing recorded, three model
turns a row with an interaction's user turns between them, n=2 samples of prompts of two lengths (left padding), one
row cut by the response budget in its last turn. Each row's joined record is checked against
  * the rule, exactly: position p carries the record of the first generate call that fed p (call c feeds the row's
    context and its generated tokens but the last); the row's last token, and no other, carries the no-record mark;
  * an independent reference: the transformers model's router top-k of one teacher-forced forward of the whole row
    (prompt + response), equal at every position except near-ties of that router (k-th and (k+1)-th logits within
    NEAR_TIE; their count is bounded).
Planted: the turn's record shifted by one position at the turn boundary, and the user tokens (and each turn's last
model token) left unrecorded; both fail.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.agent import Replies, chatml_tokenizer
from tests.helpers.moe_models import hf_moe_model
from tripod.engine.agent import loop as loop_mod
from tripod.engine.agent.chat_suffix import ChatSuffix
from tripod.engine.agent.loop import MODEL, USER, AgentLoop
from tripod.engine.rollout.base import FINISH_LENGTH, RolloutOutput, SamplingParams
from tripod.engine.rollout.routing_record import join_turn
from tripod.parallel.router_replay import routing_dtype

RESPONSE_LENGTH, N, SEED = 60, 2, 7  # a seed whose run cuts a row at the budget
# the interaction, Replies(2, "ok"): "ok" to the first two model turns, the row ends after the third
STOPS = tuple(range(60, 85))  # a quarter of the vocabulary ends a model turn: a random model's turns stay short
NEAR_TIE = 1e-4  # router logit gap under which fp32 prefill and decode may pick different experts
MAX_NEAR_TIE_FRAC = 0.02


@dataclass
class Run:
    prompts: list[list[int]]
    rows: list
    calls: list[tuple[list[list[int]], RolloutOutput]]  # every generate call's prompts and output
    hf: torch.nn.Module
    num_experts: int


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    from safetensors.torch import load_file

    from tripod.engine.rollout import make_rollout_engine
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.convert import family_of, hf_to_megatron

    torch.set_num_threads(1)
    tok = chatml_tokenizer()
    hf = hf_moe_model("qwen3_moe", 5, vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    hf_dir = str(tmp_path_factory.mktemp("moe"))
    hf.save_pretrained(hf_dir, safe_serialization=True)
    arch = arch_from_hf(hf_dir)
    canon = hf_to_megatron(arch, load_file(os.path.join(hf_dir, "model.safetensors")))
    engine = make_rollout_engine("embedded", arch, None, pad_token_id=0)
    engine.load_weights({n: family_of(arch).shard(arch, n, t, 1, 0) for n, t in canon.items()})
    engine.record_routing = True
    calls = []

    def generate(prompts, params, row_seeds=None):
        out = engine.generate(prompts, params, row_seeds)
        calls.append(([list(p) for p in prompts], out))
        return out

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 99, (k,), generator=g).tolist() for k in (6, 11)]
    loop = AgentLoop(tok, RESPONSE_LENGTH, ChatSuffix(tok), None, Replies(2, "ok"))
    rows, _ = loop.run(SimpleNamespace(generate=generate), prompts, N, SamplingParams(max_new_tokens=RESPONSE_LENGTH, seed=SEED,
                                                            stop_token_ids=STOPS),
                       [{"interaction_kwargs": {"name": "again"}}] * len(prompts))
    return Run(prompts, rows, calls, hf, arch.moe.num_experts)


def first_fed_reference(r: Run) -> tuple[list[torch.Tensor], int]:
    """(each row's record by the rule, from the generate calls' raw records: position p takes the record of the first
    call that fed it (a call feeds the row's context and its generated tokens but the last), the row's last token
    the no-record mark; how many positions a later call's prefill routed differently)."""
    out, recomputed_differ = [], 0
    for i, t in enumerate(r.rows):
        seq = r.prompts[i // N] + t.response
        ref = torch.full((len(seq), *r.calls[0][1].routed_experts[0].shape[1:]), -1, dtype=torch.long)
        for c, (prompts, o) in enumerate(r.calls):
            # call c's rows: the rows that had more than c model turns, in order (one context each)
            live = [j for j, u in enumerate(r.rows) if u.assistant_turns > c]
            if i not in live:
                continue
            k = live.index(i)
            fed = min(len(prompts[k]) + int(o.response_lengths[k]) - 1, len(seq))  # a cut row: less
            assert seq[:fed] == (prompts[k] + o.responses()[k])[:fed]
            done = ref[:fed, 0, 0] >= 0
            recomputed_differ += int((ref[:fed][done] != o.routed_experts[k][:fed][done].long()).any(-1).any(-1).sum())
            todo = (~done).nonzero().flatten()
            ref[todo] = o.routed_experts[k][todo].long()
        ref[-1] = r.num_experts
        assert (ref >= 0).all(), f"row {i}: a position fed by no call"
        out.append(ref)
    return out, recomputed_differ


def hf_reference(r: Run) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each row's (top-k expert ids [T, L, k] ascending, near-tie flags [T, L], the k-th minus the (k+1)-th router
    logit [T, L]) of the transformers model's routers in one teacher-forced forward of the whole row."""
    out = []
    for i, t in enumerate(r.rows):
        seq = torch.tensor([r.prompts[i // N] + t.response])
        with torch.no_grad():
            logits = r.hf(seq, output_router_logits=True).router_logits  # per MoE layer [T, E]
        logits = torch.stack([x.view(seq.shape[1], -1).float() for x in logits], dim=1)  # [T, L, E]
        k = r.calls[0][1].routed_experts[0].shape[-1]
        top = logits.topk(k + 1, dim=-1)
        gap = top.values[..., k - 1] - top.values[..., k]
        out.append((top.indices[..., :k].sort(-1).values, gap < NEAR_TIE, gap))
    return out


def check(r: Run) -> dict[str, float]:
    """The module docstring's checks; returns the counts (and the smallest router logit gap met)."""
    (rule, recomputed_differ), hf = first_fed_reference(r), hf_reference(r)
    counts = {"positions": 0, "model_positions": 0, "user_positions": 0, "near_ties": 0, "rule_mismatch": 0,
              "hf_mismatch": 0, "hf_mismatch_model": 0, "recomputed_differ": recomputed_differ,
              "min_gap": min(float(g[:-1].min()) for _, _, g in hf)}
    for i, t in enumerate(r.rows):
        got = t.routed_experts
        seq_len = len(r.prompts[i // N]) + len(t.response)
        assert got is not None and got.dtype == routing_dtype(r.num_experts), f"row {i}: {got}"
        assert got.shape[0] == seq_len, f"row {i}: {got.shape[0]} positions, the row has {seq_len}"
        marked = (got == r.num_experts).all(-1).all(-1)
        assert marked.nonzero().flatten().tolist() == [seq_len - 1], \
            f"row {i}: no-record mark at {marked.nonzero().flatten().tolist()}, expected only the last {seq_len - 1}"
        wrong = (got.long() != rule[i]).any(-1).any(-1)
        counts["rule_mismatch"] += int(wrong.sum())
        ids, tie, _ = hf[i]
        off = (got.long()[:-1] != ids[:-1]).any(-1)  # [T - 1, L]
        excused = off & tie[:-1]
        counts["positions"] += seq_len - 1
        counts["near_ties"] += int(tie[:-1].any(-1).sum())
        counts["hf_mismatch"] += int((off & ~excused).any(-1).sum())
        model = torch.tensor([c == MODEL for c in t.codes[:-1]])
        p = len(r.prompts[i // N])
        counts["model_positions"] += int(model.sum())
        counts["user_positions"] += sum(c == USER for c in t.codes)
        counts["hf_mismatch_model"] += int((off & ~excused).any(-1)[p:][model].sum())
    assert counts["rule_mismatch"] == 0, f"positions not carrying their first forward's record: {counts}"
    assert counts["hf_mismatch"] == 0, f"positions routed elsewhere than the teacher-forced reference: {counts}"
    assert counts["near_ties"] <= MAX_NEAR_TIE_FRAC * counts["positions"], f"too many near-ties to excuse: {counts}"
    return counts


def test_the_run_exercises_turns_samples_and_the_budget(run):
    assert len(run.calls) == 3 and [len(c[0]) for c in run.calls] == [4, 4, 4]  # every row's turn per call
    assert all(t.assistant_turns == 3 and t.user_turns == 2 for t in run.rows)
    assert any(t.finish == FINISH_LENGTH and len(t.response) == RESPONSE_LENGTH for t in run.rows)
    # the cut row's last turn generated more than it kept
    cut = next(i for i, t in enumerate(run.rows) if t.finish == FINISH_LENGTH)
    assert int(run.calls[2][1].response_lengths[cut]) > run.rows[cut].turns[-1]["n_tokens"]
    assert run.rows[0].response != run.rows[1].response  # the n samples differ
    assert any(turn["role"] == "assistant" and turn["n_tokens"] > 3 for t in run.rows for turn in t.turns)


def test_joined_record_is_each_positions_first_forward_and_matches_a_teacher_forced_pass(run):
    counts = check(run)
    print(f"joined routing record: {counts}")
    assert counts["model_positions"] > 0 and counts["user_positions"] > 0


def rerun(run: Run, join, monkeypatch) -> Run:
    """The loop run again over the same generate outputs (replayed in order) with `join` as its `join_turn`."""
    monkeypatch.setattr(loop_mod, "join_turn", join)
    replay = iter(run.calls)

    def generate(prompts, params, row_seeds=None):
        want, out = next(replay)
        assert [list(p) for p in prompts] == want, "the replayed loop asked for other contexts"
        return out

    tok = chatml_tokenizer()
    rows, _ = AgentLoop(tok, RESPONSE_LENGTH, ChatSuffix(tok), None, Replies(2, "ok")).run(
        SimpleNamespace(generate=generate), run.prompts, N, SamplingParams(max_new_tokens=RESPONSE_LENGTH, seed=SEED, stop_token_ids=STOPS),
        [{"interaction_kwargs": {"name": "again"}}] * len(run.prompts))
    return Run(run.prompts, rows, run.calls, run.hf, run.num_experts)


def shifted_at_the_boundary(joined, turn, context, generated, kept):
    """Planted: the new turn's record taken from one position early (each position gets its left neighbour's)."""
    out = join_turn(joined, turn, context, generated, kept)
    if joined is not None:
        fed = joined.shape[0] - 1
        out[fed:-1] = turn[fed - 1: context + kept - 2]
    return out


def context_unrecorded(joined, turn, context, generated, kept):
    """Planted: only the turn's own tokens take its record; the previous turn's last model token and the user tokens
    (fed in this turn's prefill) keep the no-record mark."""
    out = join_turn(joined, turn, context, generated, kept)
    if joined is not None:
        out[joined.shape[0] - 1: context] = turn[-1]
    return out


@pytest.mark.parametrize("plant, message", [(shifted_at_the_boundary, "first forward's record"),
                                            (context_unrecorded, "no-record mark at")])
def test_planted_join_bugs_fail(run, plant, message, monkeypatch):
    again = rerun(run, join_turn, monkeypatch)  # the replay itself reproduces the loop's record
    assert all(torch.equal(a.routed_experts, b.routed_experts) for a, b in zip(again.rows, run.rows))
    with pytest.raises(AssertionError, match=message) as caught:
        check(rerun(run, plant, monkeypatch))
    print(f"planted {plant.__name__}: {str(caught.value).splitlines()[0]}")


def test_dense_engines_leave_the_record_out():
    from tests.helpers.agent import ScriptedEngine

    tok = chatml_tokenizer()
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "1+2?"}], add_generation_prompt=True,
                                                tokenize=False), add_special_tokens=False)
    rows, _ = AgentLoop(tok, 50, ChatSuffix(tok)).run(ScriptedEngine(tok), [prompt], 2,
                                                      SamplingParams(max_new_tokens=50))
    assert all(t.routed_experts is None for t in rows)


def test_join_turn_refuses_a_record_of_another_length():
    turn = torch.zeros(7, 3, 2, dtype=torch.uint8)
    turn[:, :, 1], turn[-1] = 3, 4
    assert join_turn(None, turn, 5, 2, 1).shape == (6, 3, 2)
    with pytest.raises(ValueError, match="expected the context"):
        join_turn(None, turn, 4, 2, 2)
    unmarked = turn.clone()
    unmarked[-1] = 1
    with pytest.raises(ValueError, match="no-record mark"):
        join_turn(None, unmarked, 5, 2, 2)
