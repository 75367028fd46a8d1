"""Every module of a built model lives on the device megatron built it on (issue 18 item 5).

On a GPU (use_cpu_initialization=False) megatron allocates on torch.cuda.current_device(); the critic's ValueHead and
the HF RoPE frequencies tripod installs used to stay on the host, so a critic forward without megatron's DDP buffers
(DP=1, no distributed optimizer) mixed devices. On CPU the "accelerator" is played by the meta device: megatron's
current_device answers meta, and every parameter, buffer and the rotary frequencies must follow it."""
import subprocess
import sys
import textwrap

from tests.helpers.common import REPO_ROOT

SCRIPT = textwrap.dedent("""
    import os, sys
    import torch
    import torch.distributed as dist
    from tripod.parallel.megatron_patches.cpu_compat import apply_cpu_compat
    apply_cpu_compat()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
    dist.init_process_group("gloo", rank=0, world_size=1)
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.layout import ParallelLayout
    from tripod.parallel.model import build_gpt_model

    arch = arch_from_hf(sys.argv[1])
    layout = ParallelLayout(tp=1, pp=1, name="critic", arch=arch)
    torch.cuda.current_device = lambda: torch.device("meta")  # where megatron allocates without CPU initialization
    model = build_gpt_model(arch, layout, value_head=True, use_cpu_initialization=False)
    where = {n: t.device.type for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    where["rotary_pos_emb.inv_freq"] = model.rotary_pos_emb.inv_freq.device.type
    off = {n: d for n, d in where.items() if d != "meta"}
    assert not off, off
    print("ALL_ON_DEVICE", len(where))
""")


def test_every_module_is_built_on_the_model_device(tmp_path):
    from tests.helpers.common import free_port, make_tiny_hf_model

    model = make_tiny_hf_model(tmp_path, "qwen2")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(model), str(free_port())], cwd=REPO_ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0 and "ALL_ON_DEVICE" in proc.stdout, proc.stdout[-3000:]
