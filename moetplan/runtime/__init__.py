"""The vLLM plugin and what it serves routed experts with. It reads the Plan's runtime section (Plan.runtime) only.

    plugin.py   entry point (`vllm.general_plugins`): registers the method, the CPU fixes, the model-loader hook and
                the runner hook a replaying plan needs
    vllm/       what vLLM calls: the "moetplan" quantization config and MoE method, the WorkerRuntime (one per
                process: layer states, store, reserve, run record), the custom op, the fixes; the only room that
                imports vLLM (through moetplan.vllm_compat)
    op/         the routed-expert op: the dispatch table (CUDA paths, CPU kernels) and the torch reference
    store/      the GPU expert cache over pinned host RAM / NVMe packs, its heat, the replay record of a missed step
    format/     the 2-bit / FP4 format, pack files, checkpoint readers, the quantizer that writes packs
    reserve/    the FP4 reserve of hot experts and the confidence gate
    offline/    tools outside serving: routing-trace replay, the quality harness

op/, store/ and format/ import no vLLM at any depth (tests/test_architecture.py).
"""
