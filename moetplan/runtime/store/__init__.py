"""The tiered expert store: the GPU slot pool over a backing store (pinned host RAM, NVMe packs), its heat, and
the replay record of a step that missed. Imports no vLLM."""
