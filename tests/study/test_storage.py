"""What a study records about the machine its trials ran on (autofit.study.storage)."""

from __future__ import annotations

from autofit.study import storage


def test_the_recorded_environment_is_the_trials_own(monkeypatch):
    """summary.md's Environment section shows the OpenMP wait policy the trials ran with: autofit's
    PASSIVE where the user set none, theirs where they did."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert storage._versions()["env"]["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert storage._versions()["env"]["OMP_WAIT_POLICY"] == "ACTIVE"


def test_a_claim_still_being_written_is_waited_for_before_a_later_claim_checks_it():
    """Two machines claim the same config at once. The earlier claim's params and signature are written
    after the later machine has asked for its own trial: reading at once, the later one does not see the
    earlier claim (both would run it); settled_records waits until the earlier claim is whole, so the later
    one finds it and yields."""
    import threading

    import optuna

    from autofit.core.config import TrainConfig
    from autofit.core.space import space_from_dict
    from autofit.study.worker import _claimed_elsewhere

    storage.quiet_optuna()
    space = space_from_dict({"precision": ["fp32"], "micro_batch": [4, 8], "global_batch": 8})
    dists = storage.distributions(space)
    config = TrainConfig("fp32", 8, 1)
    params = {name: value.value if hasattr(value, "value") else value for name, value in config.to_dict().items()}
    study = optuna.create_study()
    earlier = study.ask()  # the other machine's claim: its trial exists, its params are not written yet
    study.enqueue_trial(params)
    later = study.ask(fixed_distributions=dists)
    storage.sign_claim(later, {"host": "b"}, {}, 1)
    assert storage.config_of(later.params) == config

    assert _claimed_elsewhere(storage.settled_records(study, later.number, wait_s=0.0), later.number, config, 1) is None

    def finish_earlier_claim() -> None:
        for name, dist in dists.items():
            study._storage.set_trial_param(earlier._trial_id, name, dist.to_internal_repr(params[name]), dist)
        storage.sign_claim(earlier, {"host": "a"}, {}, 1)

    writer = threading.Timer(0.2, finish_earlier_claim)
    writer.start()
    records = storage.settled_records(study, later.number, wait_s=5.0)
    writer.join()
    assert _claimed_elsewhere(records, later.number, config, 1) == earlier.number
