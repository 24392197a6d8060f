"""Profiling a workload on fake tensors: the timeline, one precision's trace, the profile's data types, its cache and worker processes."""
