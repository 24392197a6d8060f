"""Predictions from a profile: the memory model (one device, FSDP ranks, CUDA overhead), step times, communication, calibration and advice."""
