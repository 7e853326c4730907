"""moetplan: plan, launch and measure frontier MoE models on the GPUs you have."""
__version__ = "0.1.0"
