"""The vLLM plugin and what it serves routed experts with. It reads the Plan's runtime section (Plan.runtime) only.

In a vLLM worker:
    plugin.py          entry point: registers the method, the CPU fixes (cpu_amx, rotary_fix), the model-loader hook
    vllm_config.py     the "moetplan" QuantizationConfig: holds the process's WorkerRuntime
    vllm_method.py     the MoE method per routed-experts layer: load, re-quantize or read packs, place
    worker.py          WorkerRuntime: one per process; layer states, store, reserve, run record
    layer.py           one layer's experts as the op computes them (resident, tiered, unquantized)
    moe_op.py          the opaque custom op torch.compile sees
    expert_source.py   a layer's checkpoint experts as exact values (bf16 / FP8)
    pack_resolve.py    which pack a worker reads or writes
    reserve_build.py   building the FP4 reserve and installing the confidence gate
    tiers.py           the store factory the runtime section sizes (expert_store), the worker's tiered store
The op and its kernels:
    ops.py             moe_forward: the dispatch table (kernel paths, torch reference fallback), the path log
    cuda_paths.py      the CUDA paths per token chunk, chosen by the KernelPolicy
    reference.py       the torch MoE reference (the oracle)
    kernels.py         building and loading the CUDA extension (csrc/)
Storage:
    format.py          the 2-bit / FP4 quantizer (the row layout is contract.layout)
    sources.py         checkpoint formats (FP8, NVFP4, MXFP4) decoded exactly
    packs.py           pack files: the persistent quantization cache
    checkpoint.py, quantize_ckpt.py   reading a checkpoint's experts, `moetplan quantize`
    slots.py, store.py, backing.py, heat.py, progress.py   the GPU expert cache over host RAM / NVMe
    reserve.py, reserve_sources.py, gate.py   the FP4 reserve and the confidence gate
    records.py         runtime counters and the run record
Tools: trace.py (routing traces through the store), quality.py (the quality harness on a trained tiny MoE).
"""
