"""The run's lock inside a Slurm batch job (issue 40): a job Slurm requeued after it lost the node its
launcher ran on finds that launcher's lock. Its holder names the job and the job's run
(SLURM_RESTART_COUNT); only the same job in an earlier run is stale by Slurm's word, never another job,
the same run, or a holder of the wrong shape (the lock file is the training account's to write). The
take-over itself, through node_ctl, is tested on the real Slurm (tests/local/test_slurm_login.py)."""

from __future__ import annotations

from trainer.controller.launcher.runlock import RunLock
from trainer.controller.launcher.slurm_allocation import restart_count


def lock(job: str = "41", restart: int = 1) -> RunLock:
    return RunLock("r", "/shared/runs/r/launch", slurm_run=(job, restart))


def test_the_holder_names_the_slurm_job_and_its_run():
    holder = lock().holder()
    assert (holder["slurm_job"], holder["slurm_restart"]) == ("41", 1)
    assert "slurm_job" not in RunLock("r", "/x").holder(), "an SSH launch names no job"


def test_only_the_same_job_in_an_earlier_run_is_stale():
    before_the_requeue = lock(restart=0).holder()
    assert lock(restart=1).earlier_run_of_job(before_the_requeue)
    assert not lock(restart=0).earlier_run_of_job(before_the_requeue), "the same run: a live launcher"
    assert not lock("42", 1).earlier_run_of_job(before_the_requeue), "another job's launcher"
    assert not RunLock("r", "/x").earlier_run_of_job(before_the_requeue), "an SSH launch never takes it"
    for bad in ({**before_the_requeue, "slurm_restart": "0"}, {**before_the_requeue, "slurm_restart": False},
                {"slurm_job": "41"}, None, []):  # fmt: skip
        assert not lock().earlier_run_of_job(bad), bad


def test_the_restart_count_comes_from_slurm_and_is_0_without_it():
    assert restart_count({"SLURM_RESTART_COUNT": "2"}) == 2
    assert restart_count({}) == 0 and restart_count({"SLURM_RESTART_COUNT": "x"}) == 0
