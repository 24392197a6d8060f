"""Real trials: one config measured in an isolated child process, on one device, as pipeline stages or as FSDP ranks; applying a config to a user's loop."""
