"""4-rank gloo world: expert-parallel layouts seen through megatron's own parallel_state getters.

argv: none. For each (tp, pp, ep, etp) below, every rank builds the layout, enters `activate()` and prints
what megatron's parallel_state says about its expert groups next to what the layout says; the test compares them.
"""
import torch.distributed as dist

from tripod.parallel.layout import ParallelLayout
from tripod.parallel.megatron_patches import apply_megatron_patches


def main() -> None:
    dist.init_process_group("gloo")
    apply_megatron_patches()  # parallel_state only: no model, so no CPU shims
    from megatron.core import parallel_state as ps

    me = dist.get_rank()
    for tp, pp, ep, etp in ((1, 1, 2, 1), (2, 1, 2, 1), (1, 2, 2, 1), (1, 1, 4, 1), (2, 1, 2, 2), (2, 2, 1, 1)):
        layout = ParallelLayout(tp=tp, pp=pp, ep=ep, etp=etp, name=f"t{tp}p{pp}e{ep}x{etp}")
        with layout.activate():
            got = (ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank(),
                   ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank(),
                   ps.get_expert_data_parallel_world_size(), ps.get_expert_data_parallel_rank(),
                   dist.get_process_group_ranks(ps.get_expert_tensor_and_model_parallel_group()))
            pgc = layout.pg_collection
            pgc_sizes = (pgc.ep.size(), pgc.expt_tp.size(), pgc.expt_dp.size(), pgc.tp_ep.size())
        want = (ep, layout.ep_rank, etp, layout.etp_rank, layout.edp,
                layout.group_ranks("expt_dp").index(me), layout.group_ranks("tp_ep"))
        print(f"EXPERT {layout.name} rank {me} megatron={got} layout={want} pgc={pgc_sizes}", flush=True)
        assert got == want and pgc_sizes == (ep, etp, layout.edp, ep * etp), (got, want, pgc_sizes)
    print("EXPERT_LAYOUT_OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
