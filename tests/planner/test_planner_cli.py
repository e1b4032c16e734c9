"""CLI: plan table and JSON, estimate JSON, errors naming the option."""

import json

from click.testing import CliRunner

from tessera.planner.cli import plan_group

MODEL = "layers=8,hidden=512,heads=8,seq=512,vocab=1024"


def test_plan_json_parses_and_is_ranked():
    result = CliRunner().invoke(plan_group, ["--model", MODEL, "--cluster", "a100-40gb:4x2",
                                             "--gbs", "32", "--top", "3", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    times = [r["step_time_s"] for r in data["results"]]
    assert len(times) == 3 and times == sorted(times)
    assert data["candidates_total"] > data["candidates_evaluated"] > 0


def test_plan_table():
    result = CliRunner().invoke(plan_group, ["--model", "gpt2", "--cluster", "h100-80gb:8x1",
                                             "--gbs", "64", "--top", "2"])
    assert result.exit_code == 0, result.output
    assert "dp=" in result.output and "MFU" in result.output


def test_plan_says_which_strategies_train_runs():
    args = ["--model", "llama-70b", "--cluster", "h100-80gb:8x16", "--gbs", "1024", "--top",
            "5", "--json"]
    ranked = json.loads(CliRunner().invoke(plan_group, args).output)["results"]
    # The fastest strategies for this model shard with memory=zero*, which train refuses.
    assert [r["runnable"] for r in ranked] == [
        "memory=zero" not in r["strategy"] for r in ranked]
    assert not all(r["runnable"] for r in ranked)
    runnable = json.loads(CliRunner().invoke(plan_group, args + ["--available-only"]).output)
    assert all(r["runnable"] for r in runnable["results"])
    table = CliRunner().invoke(plan_group, args[:-1])
    assert "not yet" in table.output and "--available-only" in table.output


def test_estimate_json_has_the_figures():
    result = CliRunner().invoke(plan_group, [
        "estimate", "--model", "gpt3-175b", "--cluster", "a100-80gb:8x64", "--strategy",
        "dp=32,tp=8,pp=2,mbs=1,gbs=1536,recompute=full,schedule=1f1b", "--precision", "bf16",
        "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    for key in ("step_time_s", "tokens_per_s", "tflops_per_device", "mfu",
                "memory_per_device_bytes", "breakdown"):
        assert key in data
    assert data["step_time_s"] > 0 and set(data["breakdown"]) >= {"compute", "dp_comm"}


def test_estimate_text():
    result = CliRunner().invoke(plan_group, [
        "estimate", "--model", "gpt2", "--cluster", "cpu:2x1", "--strategy",
        "dp=2,tp=1,pp=1,mbs=2,gbs=8"])
    assert result.exit_code == 0, result.output
    assert "step_time_s" in result.output and "breakdown" in result.output


def test_errors_name_the_problem():
    runner = CliRunner()
    bad_model = runner.invoke(plan_group, ["--model", "layers=2,hidden=64,heads=4,wings=2",
                                           "--cluster", "cpu:2x1", "--gbs", "4"])
    assert bad_model.exit_code == 2 and "wings" in bad_model.output
    bad_cluster = runner.invoke(plan_group, ["--model", "gpt2", "--cluster", "tpu:8x1",
                                             "--gbs", "4"])
    assert bad_cluster.exit_code == 2 and "tpu" in bad_cluster.output
    missing = runner.invoke(plan_group, ["--model", "gpt2", "--cluster", "cpu:2x1"])
    assert missing.exit_code == 2 and "--gbs" in missing.output
    bad_strategy = runner.invoke(plan_group, ["estimate", "--model", "gpt2", "--cluster",
                                              "cpu:2x1", "--strategy", "dp=3,tp=1,pp=1,gbs=3"])
    assert bad_strategy.exit_code == 2 and "needs 3 devices" in bad_strategy.output
    bad_text = runner.invoke(plan_group, ["estimate", "--model", "gpt2", "--cluster", "cpu:2x1",
                                          "--strategy", "dp=2,gbs=3"])
    assert bad_text.exit_code == 2 and "gbs=3" in bad_text.output


def test_infeasible_plan_exits_nonzero_with_advice():
    result = CliRunner().invoke(plan_group, ["--model", "gpt3-175b", "--cluster",
                                             "a100-40gb:8x1", "--gbs", "8"])
    assert result.exit_code == 1
    assert "short by" in result.output
