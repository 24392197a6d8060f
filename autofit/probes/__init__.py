"""Measurements of this machine: device rates, the CUDA context and workspaces, collective links, the timing of one real layer."""
