"""The cores thread defaults start from: affinity capped by a cgroup CPU quota."""

import os
import subprocess
import sys

import pytest

from kvpark.kernels import cores, worker_pool


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def test_v2_quota_is_the_tightest_on_the_way_up(tmp_path):
    write(tmp_path / "proc", "0::/kubepods/pod1/ctr\n")
    write(tmp_path / "cg/cpu.max", "max 100000")
    write(tmp_path / "cg/kubepods/pod1/cpu.max", "150000 100000")  # the pod's limit: 1.5 CPUs
    write(tmp_path / "cg/kubepods/pod1/ctr/cpu.max", "max 100000")
    found = cores.quota_cpus(tmp_path / "cg", tmp_path / "proc")
    assert found == (1.5, str(tmp_path / "cg/kubepods/pod1/cpu.max"))
    write(tmp_path / "cg/kubepods/pod1/ctr/cpu.max", "400000 100000")
    assert cores.quota_cpus(tmp_path / "cg", tmp_path / "proc")[0] == 1.5


def test_a_container_sees_its_own_cgroup_at_the_root(tmp_path):
    # without a cgroup namespace /proc/self/cgroup names the host's path, absent in the mount
    write(tmp_path / "proc", "0::/system.slice/docker-abc.scope\n")
    write(tmp_path / "cg/cpu.max", "200000 100000")
    assert cores.quota_cpus(tmp_path / "cg", tmp_path / "proc")[0] == 2.0


def test_v1_cpu_controller_quota(tmp_path):
    write(tmp_path / "proc", "4:memory:/x\n2:cpu,cpuacct:/kvtest\n0::/\n")
    write(tmp_path / "cg/cpu/cpu.cfs_quota_us", "-1")
    write(tmp_path / "cg/cpu/cpu.cfs_period_us", "100000")
    write(tmp_path / "cg/cpu/kvtest/cpu.cfs_quota_us", "50000")
    write(tmp_path / "cg/cpu/kvtest/cpu.cfs_period_us", "100000")
    assert cores.quota_cpus(tmp_path / "cg", tmp_path / "proc") == (
        0.5, str(tmp_path / "cg/cpu/kvtest/cpu.cfs_quota_us"))
    write(tmp_path / "cg/cpu/kvtest/cpu.cfs_quota_us", "-1")
    assert cores.quota_cpus(tmp_path / "cg", tmp_path / "proc") is None


@pytest.mark.parametrize("text", ["", "max", "abc 100000", "100000 0", "0 100000"])
def test_unreadable_quota_text_is_no_quota(tmp_path, text):
    write(tmp_path / "proc", "0::/\n")
    write(tmp_path / "cg/cpu.max", text)
    assert cores.quota_cpus(tmp_path / "cg", tmp_path / "proc") is None


def test_no_cgroup_files_no_quota(tmp_path):
    assert cores.quota_cpus(tmp_path / "absent", tmp_path / "absent-proc") is None
    write(tmp_path / "proc", "0::/\n")
    write(tmp_path / "cg/cpu.max", "max 100000")
    assert cores.quota_cpus(tmp_path / "cg", tmp_path / "proc") is None


def test_usable_cores_is_the_affinity_capped_by_the_quota_rounded_up(monkeypatch):
    monkeypatch.setattr(cores, "affinity_cores", lambda: 64)
    monkeypatch.setattr(cores, "quota_cpus", lambda: (1.5, "/sys/fs/cgroup/cpu.max"))
    assert cores.usable_cores() == cores.Cores(2, "CPU quota 1.5 in /sys/fs/cgroup/cpu.max")
    monkeypatch.setattr(cores, "quota_cpus", lambda: (0.1, "/sys/fs/cgroup/cpu.max"))
    assert cores.usable_cores().count == 1
    monkeypatch.setattr(cores, "quota_cpus", lambda: (96.0, "/sys/fs/cgroup/cpu.max"))
    assert cores.usable_cores() == cores.Cores(64, "CPU affinity")
    monkeypatch.setattr(cores, "quota_cpus", lambda: None)
    assert cores.usable_cores() == cores.Cores(64, "CPU affinity")


def test_kernel_threads_default_follows_the_quota_and_the_pool_size(monkeypatch):
    monkeypatch.setattr(cores, "affinity_cores", lambda: 128)
    monkeypatch.setattr(cores, "quota_cpus", lambda: None)
    assert worker_pool.default_num_threads() == worker_pool.MAX_THREADS == 64
    monkeypatch.setattr(cores, "quota_cpus", lambda: (4.0, "/sys/fs/cgroup/cpu.max"))
    assert worker_pool.default_num_threads() == 4


def test_this_machine_reads_without_error():
    found = cores.usable_cores()
    assert 1 <= found.count <= cores.affinity_cores()


def real_cgroup_v1_cpu(tmp_name: str):
    """A fresh cgroup v1 cpu group, where this machine lets the tests make one (root, v1)."""
    parent = cores.CGROUP_ROOT / "cpu"
    if not (parent / "cpu.cfs_quota_us").is_file() or not os.access(parent, os.W_OK):
        pytest.skip("no writable cgroup v1 cpu controller here (needs root on a v1/hybrid host)")
    folder = parent / tmp_name
    try:
        folder.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a cgroup here: {exc}")
    return folder


def test_a_real_cgroup_quota_caps_the_cores_a_process_sees():
    folder = real_cgroup_v1_cpu(f"kvpark-test-{os.getpid()}")
    try:
        (folder / "cpu.cfs_quota_us").write_text("50000")  # half a CPU
        code = ("import sys; from kvpark.kernels import cores, worker_pool; "
                "print(cores.usable_cores().count, worker_pool.default_num_threads())")
        enter = f"echo $$ > {folder}/cgroup.procs && exec {sys.executable} -c '{code}'"
        out = subprocess.run(["sh", "-c", enter], capture_output=True, text=True, check=True)
        assert out.stdout.split() == ["1", "1"], out
    finally:
        folder.rmdir()  # empty again: the child has exited
