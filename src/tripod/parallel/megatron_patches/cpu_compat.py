"""Run megatron-core 0.16.1 on a CPU-only torch build with gloo (fp32).

`apply_cpu_compat()` installs seven shims, once per process, and only when CUDA is absent (it is a
no-op on a GPU machine). Each shim is listed below with the megatron call sites that need it
(paths under megatron/core/, line numbers of 0.16.1; found by running megatron on CPU):

  rng_tracker      tensor_parallel/random.py:235 `CudaRNGStatesTracker.add` calls
                   torch.cuda.get_rng_state(); `fork()` swaps CUDA RNG states. Replaced by a tracker
                   of CPU generator states (same seeds, same names).
  current_device   torch.cuda.current_device() -> cpu. ~175 sites; hit on CPU runs:
                   models/common/embeddings/rotary_pos_embedding.py:162, utils.py:631
                   (GlobalMemoryBuffer), pipeline_parallel/p2p_communication.py:313/321,
                   distributed/param_and_grad_buffer.py:800/806, tensor_parallel/layers.py:552,
                   tensor_parallel/mappings.py:141/181 (sequence parallel).
  synchronize      torch.cuda.synchronize() no-op: p2p_communication.py:242/398 after batch_isend_irecv.
  cuda_device_arg  device="cuda" / Tensor.cuda() rewritten to CPU by a process-wide TorchFunctionMode:
                   pipeline_parallel/schedules.py:596/983/2138, optimizer/optimizer.py:481/485/907,
                   optimizer/clip_grads.py:103, utils.py:1207 (local_multi_tensor_l2_norm).
  tensor_type      Tensor.type() answers 'torch.cuda.FloatTensor' for fp32 CPU tensors, but only when
                   the caller is megatron code: optimizer/clip_grads.py:167 asserts it,
                   optimizer/distrib_optimizer.py:431 refuses other types, optimizer.py:671/690 branch.
  sp_torch_norm    transformer/torch_norm.py:32 refuses sequence_parallel for the local-spec norm
                   (TE/apex norms do not exist on CPU). The norm is built without SP and its params
                   are tagged `.sequence_parallel=True` so finalize_model_grads all-reduces their grads
                   over TP, exactly what the TE norm does. Installed by `apply_no_te_fixes` (below), so it
                   also holds on a GPU without TE or with megatron.use_te=false (WrappedTorchNorm there too).
  recompute_rng    tensor_parallel/random.py:447/457 (`_get_all_rng_states` / `_set_all_rng_states`,
                   used by activation recomputation's CheckpointFunction) read and restore the CUDA
                   generator. On CPU the CPU generator is the device generator, and those functions
                   already save / restore it (and the tracker's states), so the CUDA half becomes a
                   copy of the CPU state on read and a no-op on write.

Trace mode (`apply_cpu_compat(trace=True)`, also after the shims are in) records, for every shim
hit, the innermost megatron frame (file, function, line): `traced_call_sites()`. The canary test
(tests/multiprocess/test_cpu_compat.py) runs TP2xPP2 (+SP, +DistOpt) train steps under the trace and fails on a
(shim, file, function) not in `ALLOWED_CALL_SITES`, so a megatron upgrade that adds a CUDA
hard-code is noticed instead of silently shimmed. bf16 parameters work too: the Tensor.type() spoof
answers 'torch.cuda.BFloat16Tensor', which is the mixed-precision path megatron takes on GPUs
(tests/multiprocess/test_precision.py compares it with fp32).

Without Transformer Engine (never on CPU; optional on GPU) megatron-core 0.16.1 also breaks MoE and MLA
models. `apply_no_te_fixes()` (called by `apply_cpu_compat`, and by build_gpt_model whenever the local spec is built,
CPU or GPU) owns `sp_torch_norm` (above: every MoE run at TP > 1 forces SP) and the three
workarounds found by running MoE models without TE (each has a canary in tests/multiprocess/test_megatron_no_te.py
that fails once megatron fixes the bug, so the workaround can be dropped) and a fourth, found by tests/multiprocess/test_moe_training.py and
checked against transformers' own gradients by tests/multiprocess/workers/mla_tp_grad_worker.py:

  moe_te_gemm      transformer/moe/moe_utils.py:23-39 leaves `te_general_gemm` undefined when TE is missing
                   and :1192 reads it, so every MoE forward raises NameError. Defined as None (= "no TE").
  mla_have_te      extensions/transformer_engine.py replaces TE with a MagicMock, so
                   transformer/multi_latent_attention.py:54-62 sets HAVE_TE=True and :184
                   `isinstance(linear_proj, TELinear)` raises TypeError. Set back to False.
  mla_core_attn    MLA passes k_channels/v_channels to its core attention (multi_latent_attention.py) but the
                   local DotProductAttention takes neither (TypeError). `mla_local_core_attention(spec)`
                   swaps in a subclass that drops them (MLA's config sets kv_channels = v_head_dim).
  mla_rope_key_grad  with TP > 1 the local spec makes linear_kv_down_proj column-parallel; MLA all-gathers its output
                   (multi_latent_attention.py:607, backward = split) and splits off the shared RoPE key k_pos_emb,
                   which each TP rank uses for its OWN heads only. Each rank's k_pos_emb gradient is therefore a
                   partial sum and the split keeps only the owner's: linear_kv_down_proj's RoPE rows and every
                   earlier layer get wrong gradients (a TP2 PPO run drifted ~3%, 14x its bound; the forward is
                   right). Fixed by all-reducing the k_pos_emb columns of the gathered gradient over TP.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading

import torch
from torch.overrides import TorchFunctionMode

from tripod.parallel.megatron_patches import transformer_engine_installed

_MEGATRON_MARK = os.sep + "megatron" + os.sep + "core" + os.sep

# (shim, megatron/core file, function) pairs that are known and shimmed on purpose.
ALLOWED_CALL_SITES: frozenset[tuple[str, str, str]] = frozenset({
    ("rng_tracker", "tensor_parallel/random.py", "model_parallel_cuda_manual_seed"),
    ("current_device", "models/common/embeddings/rotary_pos_embedding.py", "forward"),
    ("current_device", "models/common/embeddings/rotary_pos_embedding.py", "get_freqs_non_repeated"),
    ("current_device", "utils.py", "get_tensor"),
    ("current_device", "pipeline_parallel/p2p_communication.py", "_communicate"),
    ("current_device", "pipeline_parallel/p2p_communication.py", "create_tensor_recv_prev"),
    ("current_device", "pipeline_parallel/p2p_communication.py", "create_tensor_recv_next"),
    ("current_device", "distributed/param_and_grad_buffer.py", "__init__"),
    ("current_device", "tensor_parallel/layers.py", "__init__"),
    ("current_device", "tensor_parallel/mappings.py", "_gather_along_first_dim"),
    ("current_device", "tensor_parallel/mappings.py", "_reduce_scatter_along_first_dim"),
    ("current_device", "optimizer/distrib_optimizer.py", "_build_model_and_main_param_groups"),
    ("current_device", "optimizer/distrib_optimizer.py", "__init__"),
    ("synchronize", "pipeline_parallel/p2p_communication.py", "_communicate"),
    # token-budget micro-batches at PP > 1 (variable_seq_lengths): each activation's shape is sent first
    ("current_device", "pipeline_parallel/p2p_communication.py", "_communicate_shapes"),
    ("synchronize", "pipeline_parallel/p2p_communication.py", "_communicate_shapes"),
    ("cuda_device_arg", "pipeline_parallel/schedules.py", "forward_backward_no_pipelining"),
    ("cuda_device_arg", "pipeline_parallel/schedules.py", "forward_backward_pipelining_without_interleaving"),
    ("cuda_device_arg", "pipeline_parallel/schedules.py", "forward_step"),
    ("cuda_device_arg", "optimizer/optimizer.py", "get_grad_norm"),
    ("cuda_device_arg", "optimizer/optimizer.py", "_unscale_main_grads_and_check_for_nan"),
    ("cuda_device_arg", "optimizer/optimizer.py", "step_with_ready_grads"),
    ("cuda_device_arg", "optimizer/optimizer.py", "prepare_grads"),
    ("cuda_device_arg", "optimizer/optimizer.py", "__init__"),
    ("cuda_device_arg", "optimizer/clip_grads.py", "get_grad_norm_fp32"),
    ("cuda_device_arg", "optimizer/clip_grads.py", "clip_grad_by_total_norm_fp32"),
    ("cuda_device_arg", "optimizer/clip_grads.py", "count_zeros_fp32"),
    ("cuda_device_arg", "utils.py", "local_multi_tensor_l2_norm"),
    ("cuda_device_arg", "utils.py", "local_multi_tensor_scale"),
    ("tensor_type", "optimizer/clip_grads.py", "get_grad_norm_fp32"),
    ("tensor_type", "optimizer/clip_grads.py", "clip_grad_by_total_norm_fp32"),
    ("tensor_type", "optimizer/distrib_optimizer.py", "_build_model_and_main_param_groups"),
    ("tensor_type", "optimizer/optimizer.py", "_get_model_and_main_params_data_float32"),
    ("sp_torch_norm", "transformer/torch_norm.py", "__new__"),
    # measured by tests/multiprocess/test_cpu_compat.py (TP2xPP2 + SP + DistOpt step, megatron-core 0.16.1):
    ("current_device", "models/common/embeddings/rotary_pos_embedding.py", "get_emb"),  # :162
    ("current_device", "tensor_parallel/layers.py", "backward"),  # :552
    ("current_device", "tensor_parallel/mappings.py", "_gather_along_last_dim"),  # :91
    ("sp_torch_norm", "transformer/spec_utils.py", "build_module"),  # :119 builds the norm
    ("tensor_type", "optimizer/distrib_optimizer.py", "__init__"),  # :582
    # activation recomputation (megatron.recompute_granularity=full), measured by the canary test:
    ("recompute_rng", "tensor_parallel/random.py", "_get_all_rng_states"),  # :447
    ("recompute_rng", "tensor_parallel/random.py", "_set_all_rng_states"),  # :457
})

_applied = False
_trace_on = False
_trace_lock = threading.Lock()
_traced: dict[tuple[str, str, str], int] = {}   # (shim, file, function) -> first line seen


def _megatron_caller() -> tuple[str, str, int] | None:
    """(file relative to megatron/core, function, line) of the innermost megatron frame, if any."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        idx = filename.find(_MEGATRON_MARK)
        if idx >= 0:
            rel = filename[idx + len(_MEGATRON_MARK):].replace(os.sep, "/")
            return rel, frame.f_code.co_name, frame.f_lineno
        frame = frame.f_back
    return None


def _record(shim: str) -> None:
    if not _trace_on:
        return
    site = _megatron_caller()
    if site is None:
        return
    key = (shim, site[0], site[1])
    with _trace_lock:
        _traced.setdefault(key, site[2])


def traced_call_sites() -> dict[tuple[str, str, str], int]:
    """Every (shim, megatron file, function) -> line caught since tracing was turned on."""
    with _trace_lock:
        return dict(_traced)


def unexpected_call_sites() -> list[str]:
    """Traced call sites missing from ALLOWED_CALL_SITES, as 'shim <- file:line (function)'."""
    return [f"{s} <- megatron/core/{f}:{line} ({fn})"
            for (s, f, fn), line in sorted(traced_call_sites().items()) if (s, f, fn) not in ALLOWED_CALL_SITES]


def _install_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """megatron's tracker API over CPU generator states (add / fork / get_states / set_states)."""

        def add(self, name: str, seed: int) -> None:
            _record("rng_tracker")
            if seed in self.seeds_:
                raise RuntimeError(f"seed {seed} already exists")
            if name in self.states_:
                raise RuntimeError(f"rng state {name} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise RuntimeError(f"rng state {name} is not added")
            saved = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(saved)

    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _cpu_current_device() -> torch.device:
    _record("current_device")
    return torch.device("cpu")


def _cpu_synchronize(device=None) -> None:
    _record("synchronize")


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites device='cuda' arguments and Tensor.cuda() to CPU; spoofs Tensor.type() for megatron."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")):
            _record("cuda_device_arg")
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.cuda:
            _record("cuda_device_arg")
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            _record("cuda_device_arg")
            args = (args[0], "cpu", *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            if name.startswith("torch.") and not name.startswith("torch.cuda.") and _megatron_caller():
                _record("tensor_type")
                name = "torch.cuda." + name[len("torch."):]
            return name
        return func(*args, **kwargs)


def _install_recompute_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(device="cuda", clone=False, graph_safe=False):
        _record("recompute_rng")
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        _record("recompute_rng")  # the CPU state is restored by the caller itself (torch.set_rng_state)

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state


def _allow_sequence_parallel_torch_norm() -> None:
    from megatron.core.transformer import torch_norm

    if getattr(torch_norm.WrappedTorchNorm, "_tripod_sp", False):
        return
    original_new = torch_norm.WrappedTorchNorm.__new__

    def __new__(cls, config, hidden_size, eps=1e-5, **kwargs):
        sequence_parallel = config.sequence_parallel
        if sequence_parallel:
            _record("sp_torch_norm")
        config.sequence_parallel = False
        try:
            norm = original_new(cls, config, hidden_size, eps, **kwargs)
        finally:
            config.sequence_parallel = sequence_parallel
        for p in norm.parameters():
            p.sequence_parallel = sequence_parallel
        return norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(__new__)
    torch_norm.WrappedTorchNorm._tripod_sp = True


def apply_cpu_compat(trace: bool = False, force: bool = False) -> bool:
    """Install the CPU shims (idempotent). Returns True when they are active, False on a CUDA machine
    (unless `force`: a CPU run chosen by trainer.device=cpu on a machine that has GPUs).

    `trace=True` records each megatron call site a shim catches from then on.
    """
    global _applied, _trace_on
    if torch.cuda.is_available() and not force:
        return False
    _trace_on = _trace_on or trace
    if _applied:
        return True
    _install_rng_tracker()
    _install_recompute_rng()
    torch.cuda.current_device = _cpu_current_device
    torch.cuda.synchronize = _cpu_synchronize
    apply_no_te_fixes()
    # A process-wide mode (not one per call) because the optimizer and grad clipping run outside
    # any tripod-owned call frame; its overhead was below noise in the probe (p7_overhead.py).
    CudaToCpuMode().__enter__()
    _applied = True
    return True


def apply_no_te_fixes() -> bool:
    """Install the workarounds for megatron's local (non-TE) spec (idempotent): the sequence-parallel local norm
    always (the local spec can be chosen with TE installed: megatron.use_te=false), the MoE / MLA ones when TE is
    not installed. Returns True when those are active, False when TE is installed (megatron then takes its TE paths).
    """
    _allow_sequence_parallel_torch_norm()
    if transformer_engine_installed():
        return False
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    multi_latent_attention.HAVE_TE = False
    _install_mla_rope_key_grad(multi_latent_attention)
    return True


def _install_mla_rope_key_grad(mla) -> None:
    """`mla_rope_key_grad` (module docstring): sum the RoPE-key columns of the gathered kv_down gradient over TP."""
    if getattr(mla, "_tripod_rope_key_grad", False):
        return
    gather = mla.gather_from_tensor_model_parallel_region
    original = mla.MLASelfAttention.get_query_key_value_tensors
    state = threading.local()

    def gather_kv(input_, group=None):
        out = gather(input_, group=group)
        tag = getattr(state, "kv_local", None)
        if tag is not None and tag[0] is input_ and out.requires_grad:
            rope, tp_group = tag[1], tag[2]

            def sum_rope_key_grad(grad):
                grad = grad.clone()
                part = grad[..., -rope:].contiguous()
                torch.distributed.all_reduce(part, group=tp_group)
                grad[..., -rope:] = part
                return grad

            out.register_hook(sum_rope_key_grad)
        return out

    def get_query_key_value_tensors(self, *args, **kwargs):
        if not hasattr(self, "_tripod_tag_kv"):
            def tag(module, inputs, output):  # the local kv_down output that the gather will receive
                state.kv_local = (output[0], self.config.qk_pos_emb_head_dim, self.tp_group)
            self.linear_kv_down_proj.register_forward_hook(tag)
            self._tripod_tag_kv = True
        try:
            return original(self, *args, **kwargs)
        finally:
            state.kv_local = None

    mla.gather_from_tensor_model_parallel_region = gather_kv
    mla.MLASelfAttention.get_query_key_value_tensors = get_query_key_value_tensors
    mla._tripod_rope_key_grad = True
    mla._tripod_unfixed = (gather, original)  # for the canary (tests/multiprocess/workers/mla_tp_grad_worker.py without_fix)


def _mla_local_core_attention_class():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLALocalDotProductAttention(DotProductAttention):
        """megatron's local core attention, accepting (and dropping) the per-head channels MLA passes."""

        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)

    return MLALocalDotProductAttention


def mla_local_core_attention(block_spec):
    """Point every MLA layer of a local (non-TE) decoder block spec at a core attention that takes MLA's
    k_channels/v_channels; dense-attention layers are left alone. Returns the spec."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    core = _mla_local_core_attention_class()
    for layer in block_spec.layer_specs:
        attention = layer.submodules.self_attention.submodules
        if getattr(attention, "core_attention", None) is DotProductAttention and hasattr(attention, "linear_kv_down_proj"):
            attention.core_attention = core
    return block_spec


def cpu_compat_applied() -> bool:
    return _applied
