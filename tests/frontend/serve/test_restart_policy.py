"""kvpool serve's restarts of a crashed worker: a doubling back-off, a limit on exits
in a row, and a clean slate after a healthy stretch (as systemd's start limit)."""

from __future__ import annotations

from frontend.serve.restart_policy import HEALTHY_S, MAX_BACKOFF_S, RestartPolicy


def test_exits_in_a_row_back_off_doubling_then_give_up_with_the_reason():
    policy = RestartPolicy(max_restarts=5)
    assert [policy.after_exit(ran_s=2.0) for _ in range(5)] == [1.0, 2.0, 4.0, 8.0, 16.0]
    assert policy.after_exit(ran_s=2.0) is None
    why = policy.why_give_up()
    assert "exited 6 times in a row" in why and f"within {HEALTHY_S:g} s of its start" in why and "--worker-restarts 5" in why


def test_a_healthy_stretch_resets_the_count_and_the_back_off():
    policy = RestartPolicy(max_restarts=5)
    # A week of ordinary crashes, each after hours of serving: never given up, always 1 s.
    for _ in range(50):
        assert policy.after_exit(ran_s=3600.0) == 1.0
    # Then a crash loop: counted from the last healthy run.
    assert [policy.after_exit(ran_s=1.0) for _ in range(4)] == [2.0, 4.0, 8.0, 16.0]
    assert policy.after_exit(ran_s=1.0) is None


def test_just_under_the_healthy_stretch_still_counts():
    policy = RestartPolicy(max_restarts=1, healthy_s=60.0)
    assert policy.after_exit(ran_s=59.9) == 1.0
    assert policy.after_exit(ran_s=59.9) is None
    assert RestartPolicy(max_restarts=1, healthy_s=60.0, restarts=1).after_exit(ran_s=60.0) == 1.0


def test_the_back_off_is_capped():
    policy = RestartPolicy(max_restarts=100)
    delays = [policy.after_exit(ran_s=0.5) for _ in range(10)]
    assert max(delays) == MAX_BACKOFF_S and delays[-1] == MAX_BACKOFF_S


def test_each_child_gives_up_naming_itself_and_its_flag():
    policy = RestartPolicy(max_restarts=0, name="scheduler")
    assert policy.after_exit(ran_s=1.0) is None
    why = policy.why_give_up()
    assert why.startswith("the scheduler exited 1 times in a row") and "--scheduler-restarts 0" in why
