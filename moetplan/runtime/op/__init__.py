"""The routed-expert op and its kernels: the dispatch table (CUDA, CPU) and the torch reference every path is
checked against. Imports no vLLM."""
