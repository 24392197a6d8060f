"""Running steps and processes: child processes and the fork server, device locks, the training step, schedules, the memory tracker, multi-rank groups."""
