"""The 2-bit / FP4 row format, pack files (the quantization cache and the NVMe tier), checkpoint readers and the
quantizer that writes packs. Imports no vLLM."""
