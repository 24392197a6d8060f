"""What a device split's communication costs per micro-step: FSDP's gathers and reduce-scatters and a
pipeline's sends, from the profile's bytes and the measured links (:mod:`autofit.probes.links`).
"""

from __future__ import annotations

from autofit.probes.links import LinkRates

# --------------------------------------------------------------------------------------
# Costs


def fsdp_units_bytes(pp, n_layers: int, checkpoint_every: int) -> list[tuple[float, float]]:
    """(parameter bytes, gradient bytes) of each FSDP unit (:func:`autofit.estimator.fsdp_memory.fsdp_units`),
    the root last: what the model outside its layers holds (tied weights counted once)."""
    from autofit.estimator.fsdp_memory import fsdp_units

    units = [(float(sum(pp.layers[i].param_bytes for i in range(s, e))),
              float(sum(pp.layers[i].grad_bytes for i in range(s, e)))) for s, e in fsdp_units(n_layers, checkpoint_every)]
    root = (max(pp.static_param_bytes - sum(u[0] for u in units), 0.0), max(pp.grad_bytes - sum(u[1] for u in units), 0.0))
    return units + [root] if root[0] > 0 else units


def fsdp_micro_step_seconds(pp, n_layers: int, checkpoint_every: int, links: LinkRates,
                            memory_bytes_per_s: float) -> float:
    """One rank's seconds of FSDP2 communication in one micro-step (see the module docstring)."""
    n = links.world_size
    seconds = 0.0
    for params, grads in fsdp_units_bytes(pp, n_layers, checkpoint_every):
        # The unit's fixed cost (its collectives' latencies included) was measured on a unit of no size:
        # what is left is its bytes, through the link and through memory.
        seconds += links.fsdp_unit_s + 2 * params / links.bytes_per_s["all_gather"]  # forward, again backward
        copies = 2 * 2 * params  # each gather: the shard into the flat buffer, the flat buffer out to the parameters
        if grads > 0:
            seconds += grads / links.bytes_per_s["reduce_scatter"]
            copies += 2 * grads  # the gradients into the reduce-scatter buffer
        seconds += copies * (1 + 1 / n) / memory_bytes_per_s
    return seconds


def send_seconds(boundary_bytes: float, links: LinkRates) -> float:
    """Seconds a stage spends on one boundary per micro-batch: the activations one way, their gradients back."""
    return links.seconds("send", 2 * boundary_bytes, count=2)

