"""The ``cluster simulate`` command, driven through click's test runner."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from tessera.cluster.cli import cluster_group


def test_simulate_prints_table(pollux_workload):
    result = CliRunner().invoke(cluster_group, [
        "simulate", "--workload", str(pollux_workload), "--policies", "fifo,tiresias",
        "--gpus", "64", "--limit", "30"])
    assert result.exit_code == 0, result.output
    assert "fifo" in result.output and "tiresias" in result.output


def test_simulate_json_lines(pollux_workload):
    result = CliRunner().invoke(cluster_group, [
        "simulate", "--workload", str(pollux_workload), "--policies", "ones,fifo", "--json",
        "--limit", "30", "--seed", "3"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.output.splitlines()]
    assert [r["policy"] for r in rows] == ["ones", "fifo"]
    assert all(r["finished"] == 30 and r["avg_jct"] > 0 and r["seed"] == 3 for r in rows)


def test_bad_trace_reports_file_and_line(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("name,time,application,num_replicas,batch_size\na,5,ncf,100,256\n")
    result = CliRunner().invoke(cluster_group, ["simulate", "--workload", str(bad)])
    assert result.exit_code != 0
    assert f"{bad}:2:" in result.output and "cluster has 64" in result.output


def test_unknown_policy_is_refused(pollux_workload):
    result = CliRunner().invoke(cluster_group, [
        "simulate", "--workload", str(pollux_workload), "--policies", "ones,drf"])
    assert result.exit_code != 0 and "drf" in result.output


def test_plots_written(pollux_workload, tmp_path):
    pytest.importorskip("matplotlib")
    result = CliRunner().invoke(cluster_group, [
        "simulate", "--workload", str(pollux_workload), "--policies", "fifo", "--limit", "20",
        "--plots", str(tmp_path / "plots")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "plots" / "jct_cdf.png").stat().st_size > 0
    assert (tmp_path / "plots" / "utilization.png").stat().st_size > 0
