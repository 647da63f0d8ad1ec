"""bench.cgroup_cpu: the quota and the throttling counters, read from cgroup v2's and v1's files as the kernel writes
them (a directory laid out like /sys/fs/cgroup)."""
from bench import cgroup_cpu


def _write(root, name, text):
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_counters_and_quota(tmp_path):
    _write(tmp_path, "cpu.stat", "usage_usec 9000\nuser_usec 6000\nsystem_usec 3000\nnr_periods 120\nnr_throttled 7\n"
                                 "throttled_usec 183000\nnr_bursts 0\nburst_usec 0\n")
    _write(tmp_path, "cpu.max", "400000 100000\n")
    before = cgroup_cpu.throttling(tmp_path, tmp_path / "none")
    assert before == {"periods": 120, "throttled_periods": 7, "throttled_ms": 183.0}
    assert cgroup_cpu.quota_cpus(tmp_path, tmp_path / "none") == 4.0
    _write(tmp_path, "cpu.stat", "nr_periods 150\nnr_throttled 10\nthrottled_usec 250500\n")
    after = cgroup_cpu.throttling(tmp_path, tmp_path / "none")
    assert cgroup_cpu.throttled_between(before, after) == {"periods": 30, "throttled_periods": 3, "throttled_ms": 67.5}


def test_cgroup_v1_counters_and_no_quota(tmp_path):
    v1 = tmp_path / "cpu"
    _write(v1, "cpu.stat", "nr_periods 10\nnr_throttled 2\nthrottled_time 45000000\n")
    _write(v1, "cpu.cfs_quota_us", "-1\n")
    _write(v1, "cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu.throttling(tmp_path, v1) == {"periods": 10, "throttled_periods": 2, "throttled_ms": 45.0}
    assert cgroup_cpu.quota_cpus(tmp_path, v1) is None
    _write(tmp_path, "cpu.max", "max 100000\n")
    assert cgroup_cpu.quota_cpus(tmp_path, v1) is None


def test_no_controller_visible_reads_as_none(tmp_path):
    assert cgroup_cpu.throttling(tmp_path, tmp_path / "cpu") is None
    assert cgroup_cpu.quota_cpus(tmp_path, tmp_path / "cpu") is None
    assert cgroup_cpu.throttled_between(None, {"periods": 1, "throttled_periods": 0, "throttled_ms": 0.0}) is None
