"""Trace reading: both formats, and bad rows refused with file and line."""

from __future__ import annotations

import pytest

from tessera.cluster.traces import TraceError, assign_philly_apps, load_trace

POLLUX_HEADER = "name,time,application,num_replicas,batch_size\n"
PHILLY_HEADER = "timestamp,duration,num_gpus,gpu_time,cluster\n"


def write(tmp_path, text, name="trace.csv"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_pollux_workload_reads_all_jobs_sorted(pollux_workload, models):
    jobs = load_trace(pollux_workload, max_gpus=64, apps=models.names)
    assert len(jobs) == 160
    assert [j.arrival for j in jobs] == sorted(j.arrival for j in jobs)
    assert all(j.app in models.names and 1 <= j.gpus <= 64 for j in jobs)


def test_philly_slice_is_contiguous_and_shifted_to_zero(tmp_path):
    rows = "".join(f"2017-10-01 00:0{i}:00,{100 + i},1,{100 + i},vc\n" for i in range(5))
    path = write(tmp_path, PHILLY_HEADER + rows)
    jobs = load_trace(path, max_gpus=8, limit=2, start=2)
    assert [j.arrival for j in jobs] == [0.0, 60.0]
    assert [j.duration for j in jobs] == [102.0, 103.0]
    assigned = assign_philly_apps(jobs, seed=3)
    assert assigned == assign_philly_apps(jobs, seed=3)  # deterministic under a seed
    assert all(j.app is not None for j in assigned)


@pytest.mark.parametrize("row, line, words", [
    ("a,10,cifar10,2\n", 3, "missing batch_size"),
    ("a,-5,cifar10,2,128\n", 3, "'time' must be >= 0"),
    ("a,10,cifar10,128,128\n", 3, "cluster has 64"),
    ("a,ten,cifar10,2,128\n", 3, "not a number"),
    ("a,10,resnet,2,128\n", 3, "unknown application"),
    ("a,10,cifar10,0,128\n", 3, "at least 1 GPU"),
    ("a,10,cifar10,1.5,128\n", 3, "whole number"),
])
def test_bad_pollux_rows_name_file_and_line(tmp_path, models, row, line, words):
    path = write(tmp_path, POLLUX_HEADER + "ok,1,ncf,1,256\n" + row)
    with pytest.raises(TraceError) as info:
        load_trace(path, max_gpus=64, apps=models.names)
    assert info.value.path == str(path) and info.value.line == line
    assert f"{path}:{line}:" in str(info.value) and words in str(info.value)


@pytest.mark.parametrize("row, words", [
    ("2017-10-01 00:00:00,-3,1,3,vc\n", "'duration' must be >= 0"),
    ("2017-10-01 00:00:00,0,1,0,vc\n", "duration must be > 0"),
    ("yesterday,30,1,30,vc\n", "bad timestamp"),
    ("2017-10-01 00:00:00,30,2048,30,vc\n", "cluster has 1024"),
    ("2017-10-01 00:00:00,30\n", "missing num_gpus"),
])
def test_bad_philly_rows_name_file_and_line(tmp_path, row, words):
    path = write(tmp_path, PHILLY_HEADER + row)
    with pytest.raises(TraceError, match=words) as info:
        load_trace(path, max_gpus=1024)
    assert info.value.line == 2 and str(path) in str(info.value)


def test_unknown_header_and_missing_file(tmp_path):
    with pytest.raises(TraceError, match="unknown header") as info:
        load_trace(write(tmp_path, "a,b,c\n1,2,3\n"))
    assert info.value.line == 1
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "absent.csv")
