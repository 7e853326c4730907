"""What vLLM calls: the quantization method and its MoE layers, the worker (one per process), the fixes the
plugin carries, the run record. The only room that imports vLLM."""
