"""How many GPUs a run needs and how they are split: the memory model (sizing), the layout (plan) and
the GPU facts of a node (gpus). Light side: no torch."""
