"""How `tripod plan` prints a `ReshardPlan`: its header (layouts, groups, bytes) and its per-rank numbers, either one
row per distinct rank role (PP stage and TP / EP position with the same buckets and bytes; a count column says how
many ranks play it) or, with `per_rank`, one row per rank (the full table of the world)."""
from __future__ import annotations

from tripod.parallel.hybrid_engine.plan import ReshardPlan

MIB = 1 << 20


def ranges(values: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8' (sorted, duplicates dropped)."""
    out: list[str] = []
    xs = sorted(set(values))
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)


def header_lines(plan: ReshardPlan, *, list_groups: bool) -> list[str]:
    """Layouts, micro-DP size, model bytes; the groups themselves when `list_groups` (else their count and first)."""
    experts = ""
    if plan.expert_specs:
        lay = plan.expert_layout
        experts = (f", experts EP={lay.ep} ETP={lay.etp} EDP={lay.edp} ({lay.num_experts} experts, "
                   f"{lay.n_local} per EP rank; to rollout: every expert cut over rollout TP, point to point)")
    st = plan.stages
    lines = [
        f"train layout   TP={plan.tp} PP={plan.pp} DP={plan.dp} (world {plan.world_size}){experts}"
        + (f", layers per stage {st.describe()}" if st is not None and st.uneven else ""),
        f"rollout layout TP={plan.rollout_tp} PP=1 DP={plan.world_size // plan.rollout_tp}",
        (f"regrouping     point to point (rollout TP {plan.rollout_tp} is not a divisor of TP {plan.tp}: rollout TP "
         f"groups span DP replicas / PP stages, {'ordered for locality' if plan.local_order else 'in rank order'}; "
         f"chunks of <= half a bucket)" if plan.p2p else f"micro-DP size  {plan.micro_dp_size} = (TP*PP)/(rollout TP)"),
        f"model bytes    {plan.model_bytes() / MIB:.2f} MiB ({plan.dtype}), bucket {plan.bucket_bytes / MIB:.2f} MiB",
    ]
    if plan.p2p:
        shown = plan.rollout_tp_groups if list_groups else plan.rollout_tp_groups[:1]
        lines.append(f"rollout TP groups {shown} (listed in rollout TP order)"
                     + ("" if list_groups else f", {len(plan.rollout_tp_groups)} in all"))
    elif list_groups:
        lines += [f"micro-DP groups   {plan.micro_dp_groups}", f"rollout TP groups {plan.rollout_tp_groups}"]
    else:
        lines += [f"micro-DP groups   {len(plan.micro_dp_groups)} of {plan.micro_dp_size} ranks, the first "
                  f"{plan.micro_dp_groups[0]}",
                  f"rollout TP groups {len(plan.rollout_tp_groups)} of {plan.rollout_tp} ranks, the first "
                  f"{plan.rollout_tp_groups[0]}"]
    return lines


def per_rank_table(plan: ReshardPlan) -> list[str]:
    lines = ["rank  rollout_tp_rank  buckets_sent  recv_MiB  ideal_recv_MiB  naive_recv_MiB  peak_extra_MiB"]
    if plan.p2p:
        lines.insert(0, "(point to point: buckets_sent is 0, ideal_recv is the closed form's mean over ranks)")
    if plan.expert_specs:
        lines.insert(0, "(recv_MiB includes the experts' point-to-point part; ideal/naive are HybridFlow's formulas "
                        "over the whole model)")
    for r in range(plan.world_size):
        lines.append(f"{r:>4}  {plan.rollout_tp_rank(r):>15}  {len(plan.buckets[r]):>12}  "
                     f"{plan.bytes_received(r, fast=True) / MIB:>8.2f}  {plan.bytes_received_ideal() / MIB:>14.2f}  "
                     f"{plan.bytes_received_naive() / MIB:>14.2f}  {plan.peak_extra_bytes() / MIB:>14.2f}")
    return lines


def role_table(plan: ReshardPlan) -> list[str]:
    """One row per distinct role: ranks of the same PP stage that send as many buckets and receive as many bytes
    (TP / EP / DP positions that the numbers do not tell apart share a row, and the row lists them)."""
    roles: dict[tuple[int, int, int], list[int]] = {}
    for r in range(plan.world_size):
        stage = plan.train_coords(r)[2]
        roles.setdefault((stage, len(plan.buckets[r]), plan.bytes_received(r, fast=True)), []).append(r)
    ep = plan.expert_layout if plan.expert_specs else None
    lines = [f"per-rank numbers, one row per role (--per-rank: all {plan.world_size} rows); every rank: ideal recv "
             f"{plan.bytes_received_ideal() / MIB:.2f} MiB, naive recv {plan.bytes_received_naive() / MIB:.2f} MiB, "
             f"peak extra {plan.peak_extra_bytes() / MIB:.2f} MiB (generation shard + largest bucket)",
             "ranks  pp_stage  tp_ranks      " + ("ep_ranks      " if ep else "")
             + "rollout_tp_ranks  buckets_sent  recv_MiB  e.g. rank"]
    if ep:
        lines.insert(1, "(recv_MiB includes the experts' point-to-point part)")
    for (stage, buckets, recv), members in sorted(roles.items()):
        tp_ranks = ranges([plan.train_coords(r)[0] for r in members])
        row = f"{len(members):>5}  {stage:>8}  {tp_ranks:<12}  "
        if ep:
            row += f"{ranges([ep.coords(r)[1] for r in members]):<12}  "
        row += (f"{ranges([plan.rollout_tp_rank(r) for r in members]):<16}  {buckets:>12}  {recv / MIB:>8.2f}  "
                f"{members[0]:>9}")
        lines.append(row)
    return lines


def describe_plan(plan: ReshardPlan, per_rank: bool = False) -> str:
    """The plan as `tripod plan` prints it (`per_rank`: every group and one row per rank, as before grouping)."""
    return "\n".join(header_lines(plan, list_groups=per_rank or plan.world_size <= 16)
                     + (per_rank_table(plan) if per_rank else role_table(plan)))
