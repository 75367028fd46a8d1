"""tripod parallel: per-model parallel layouts, Megatron model building, HF<->Megatron weight
conversion, the CPU compatibility layer for megatron-core, and the 3D-HybridEngine resharding."""
