"""`bench/host_stages.py`'s snapshots charge a stage what its threads have spent in it up to the snapshot, a call still
running included: a window that starts mid-call is not charged that call's time from before it (which made a thread's
``other`` fall below 0 in a CI run of `test_host_cost.py`), and nothing is counted twice once the call ends."""
import threading
import time


def test_a_snapshot_counts_a_call_still_running_once():
    from bench import host_stages

    inside, release = threading.Event(), threading.Event()

    def busy():
        until = time.thread_time() + 0.05
        while time.thread_time() < until:          # 50 ms of CPU inside the stage
            pass
        inside.set()
        release.wait(10)

    thread = threading.Thread(target=host_stages.timed("probe-stage", busy), name="probe-thread")
    thread.start()
    try:
        assert inside.wait(10)
        during = {(g, s): ns for g, s, ns, _ in host_stages.snapshot("during")["stages"]}
        assert during[("probe-thread", "probe-stage")] >= 45e6          # not yet charged, counted all the same
    finally:
        release.set()
        thread.join()
    after = {(g, s): (ns, calls) for g, s, ns, calls in host_stages.snapshot("after")["stages"]}
    ns, calls = after[("probe-thread", "probe-stage")]
    assert calls == 1 and 45e6 <= ns < during[("probe-thread", "probe-stage")] + 20e6   # charged once, at its end
