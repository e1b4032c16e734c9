"""The GPU profile (profile_gpu.py, profile_links.py) run on the CPU: its timing, measurement
and assembly code with device="cpu" and gloo, two pretend nodes of two processes for the
cross-node path. The CUDA calls themselves are exercised in tests/test_gpu.py."""

import time

import pytest
import torch
from click.testing import CliRunner

from tessera.planner import estimate, load_cluster, save_cluster
from tessera.planner.cluster import COLLECTIVES, Cluster, ClusterError, CollectiveFit
from tessera.planner.comm import Group, collective_time
from tessera.planner.compute import matmul_rate
from tessera.planner.cli import profile_command
from tessera.planner.hardware import get_device
from tessera.planner import profile_gpu
from tessera.planner.profile_gpu import (DeviceFigures, ProfileError, attention_rate,
                                         device_spec, match_preset, matmul_table, memory_rates,
                                         time_on_device)
from tessera.planner.profile_links import (CROSS_NODE_OPS, LinkFigures, LinkSizes,
                                           measure_links, node_group_sizes, run_link_worker)
from tessera.models.config import preset
from tessera.strategy import Strategy

CPU = torch.device("cpu")
# Up to 4 MiB: gloo moves ~1 GB/s here, so the largest message takes a few ms beyond the
# ~1 ms latency of 4 processes on 2 cores and the fitted bandwidth is a real slope.
TINY = LinkSizes(messages=(1 << 12, 1 << 17, 1 << 22), overlap_elements=1 << 16,
                 matmul_dim=128, ring_elements=1 << 12)


def test_timing_ends_every_batch_with_a_device_sync():
    events = []

    def call():
        events.append("call")
        time.sleep(0.001)

    seconds = time_on_device(call, lambda: events.append("sync"), min_time=0.008, repeat=2)
    # A batch is only over once the device says so: every run of calls is followed by a sync.
    batches = "".join("c" if e == "call" else "s" for e in events).split("s")
    assert events[-1] == "sync" and all(batches[:-1])
    # sleep(0.001) per call; the batch reaching 8 ms is at least 8 calls long.
    assert 0.001 <= seconds < 0.004


def test_device_measurements_run_on_any_device():
    table = matmul_table(CPU, torch.float32, [(32, 32, 32), (64, 64, 64)])
    assert [shape for shape, _ in table] == [(32, 32, 32), (64, 64, 64)]
    assert all(rate > 1e6 for _, rate in table)
    assert attention_rate(CPU, torch.float32, batch=1, heads=2, seq=64, head_dim=16) > 1e6
    bandwidth, adam_bytes = memory_rates(CPU, elements=1 << 16)
    # An AdamW step reads p, g, m, v and writes p, m, v: 28 bytes per fp32 parameter at
    # the add's rate if it streamed as well; unfused kernels make it more.
    assert bandwidth > 1e8 and adam_bytes > 16


def test_presets_are_matched_by_name_and_memory():
    assert match_preset("NVIDIA H100 80GB HBM3", 80e9) == "h100-80gb"
    assert match_preset("NVIDIA H200", 141e9) == "h200"
    assert match_preset("NVIDIA A100-SXM4-40GB", 40 * 2**30) == "a100-40gb"
    assert match_preset("NVIDIA A100-SXM4-80GB", 80 * 2**30) == "a100-80gb"
    assert match_preset("Tesla V100-SXM2-32GB", 32 * 2**30) == "v100-32gb"
    assert match_preset("NVIDIA L4", 24 * 2**30) is None


def test_node_group_sizes_stay_inside_a_node():
    assert node_group_sizes(8) == [2, 4, 8]
    assert node_group_sizes(6) == [2, 6]  # a group of 4 would straddle two nodes of 6
    assert node_group_sizes(1) == []


def _figures(name: str) -> DeviceFigures:
    table = [((1024, 1024, 1024), 300e12), ((8192, 8192, 8192), 600e12)]
    return DeviceFigures(name=name, memory_bytes=80e9, precision="bf16", table=table,
                         fp32_rate=50e12, attention_rate=300e12, memory_bandwidth=3e12,
                         adam_bytes=40.0, host_bandwidth=50e9)


def _links(nodes: int = 2) -> LinkFigures:
    intra = {"all_reduce": {2: CollectiveFit(10e-6, 150e9), 8: CollectiveFit(30e-6, 200e9)}}
    cross = {"all_reduce": CollectiveFit(20e-6, 20e9)} if nodes > 1 else {}
    return LinkFigures(intra=intra, cross=cross, nodes=nodes, overlap=0.8, ring_overlap=0.6)


def test_a_known_device_keeps_its_datasheet_peaks_and_takes_every_measurement():
    spec = device_spec(_figures("NVIDIA H100 80GB HBM3"), _links())
    h100 = get_device("h100-80gb")
    assert spec.name == "h100-80gb" and spec.peak_flops == h100.peak_flops
    assert spec.matmul_efficiency == pytest.approx(600e12 / 989.4e12)
    assert spec.attention_efficiency == pytest.approx(300e12 / 989.4e12)
    assert (spec.memory_bytes, spec.memory_bandwidth, spec.host_bandwidth) == (80e9, 3e12, 50e9)
    assert spec.optimizer_bytes_per_param == 40.0 and spec.overheads == {}
    assert (spec.overlap_efficiency, spec.ring_overlap) == (0.8, 0.6)
    # The links price the measured all_reduce as measured: inside the node from the largest
    # group's fit, across nodes from the cross-node fit (a cluster without fits uses links).
    cluster = Cluster(device=spec, devices_per_node=8, nodes=2)
    nbytes = 64e6
    assert collective_time(cluster, "all_reduce", nbytes, Group(8, 1)) == pytest.approx(
        30e-6 + nbytes / 200e9)
    assert collective_time(cluster, "all_reduce", nbytes, Group(2, 8)) == pytest.approx(
        20e-6 + nbytes / 20e9)


def test_an_unknown_device_takes_its_measured_rates_as_peaks():
    spec = device_spec(_figures("NVIDIA L4"), None)
    assert spec.name == "cuda" and spec.peak_flops == {"fp32": 50e12, "bf16": 600e12}
    assert spec.matmul_efficiency == 1.0
    # Nothing measured across nodes: the assumption is named in the link.
    assert "not measured" in spec.inter.name


def test_a_bf16_table_scales_to_other_precisions_by_their_peaks(tmp_path):
    spec = device_spec(_figures("NVIDIA H100 80GB HBM3"), _links())
    table = tuple(_figures("x").table)
    cluster = Cluster(device=spec, devices_per_node=8, matmul_table=table,
                      matmul_precision="bf16")
    path = str(tmp_path / "gpu.yaml")
    save_cluster(cluster, path)
    again = load_cluster(path)
    assert again.matmul_precision == "bf16" and again.matmul_table == table
    assert matmul_rate(again, 8192, 8192, 8192, "bf16") == pytest.approx(600e12)
    assert matmul_rate(again, 8192, 8192, 8192, "fp32") == pytest.approx(600e12 * 67 / 989.4)
    with pytest.raises(ClusterError, match="matmul_precision 'fp8'.*has no peak"):
        Cluster(device=get_device("a100-80gb"), devices_per_node=8, matmul_table=table,
                matmul_precision="fp8")
    est = estimate(preset("tiny"), again, Strategy(dp=8, micro_batch_size=1,
                                                   global_batch_size=8, precision="bf16"))
    assert 0 < est.step_time < 1


@pytest.mark.slow
def test_links_inside_and_across_two_pretend_nodes():
    links = measure_links(4, "cpu", "gloo", TINY, per_node=2)
    assert links.nodes == 2 and set(links.intra) == set(COLLECTIVES)
    assert all(set(fits) == {2} for fits in links.intra.values())
    assert set(links.cross) == set(CROSS_NODE_OPS) == {"all_reduce"}
    # A bigger message took longer: the fitted slope is real, not the fit's floor of 1e-15
    # s/B (bandwidth 1e15), which a timing loop that did not wait for the calls would give.
    for fit in (links.intra["all_reduce"][2], links.intra["all_gather"][2],
                links.cross["all_reduce"]):
        assert fit.bandwidth < 1e12
    assert links.host_bandwidth is None  # CPU processes have no host link to time


def test_processes_that_do_not_make_whole_nodes_are_refused():
    with pytest.raises(ValueError, match="3 processes do not make whole nodes of 2"):
        run_link_worker(0, 3, 2, "cpu", "gloo", TINY, "tcp://127.0.0.1:1")


def test_the_gpu_profile_measures_one_node_or_every_node_under_torchrun(monkeypatch):
    calls = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)

    def fake_device(index, quick, log):
        calls["device"] = index
        return _figures("NVIDIA H100 80GB HBM3")

    def fake_links(processes, *args):
        calls["links"] = processes
        return _links(1)

    monkeypatch.setattr(profile_gpu, "measure_device", fake_device)
    monkeypatch.setattr(profile_gpu, "measure_links", fake_links)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    one_node = profile_gpu.profile_gpu_cluster(quick=True)
    assert calls == {"links": 4, "device": 0}
    assert (one_node.devices_per_node, one_node.nodes) == (4, 1)
    assert one_node.matmul_precision == "bf16" and one_node.collectives["all_reduce"]

    raw = {"intra": {"all_reduce": {2: [(1 << 16, 1e-5), (1 << 20, 2e-5)]}},
           "cross": {"all_reduce": [(1 << 16, 3e-5), (1 << 20, 9e-5)]}, "nodes": 2,
           "overlap": 0.7, "ring_overlap": 0.5}
    monkeypatch.setattr(profile_gpu, "run_link_worker",
                        lambda rank, *args: raw if rank == 0 else None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "1")
    assert profile_gpu.profile_gpu_cluster(quick=True) is None  # rank 0 writes the file
    monkeypatch.setenv("RANK", "0")
    two_nodes = profile_gpu.profile_gpu_cluster(quick=True)
    assert (two_nodes.devices_per_node, two_nodes.nodes) == (2, 2)
    assert calls["device"] == 1  # rank 0's own device, as torchrun bound it
    assert "across 2 nodes" in two_nodes.device.inter.name


def test_cli_refuses_a_gpu_profile_without_gpus_and_cpu_options_for_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = CliRunner().invoke(profile_command, ["--device", "cuda"])
    assert result.exit_code != 0 and "no CUDA device is visible" in result.output
    result = CliRunner().invoke(profile_command, ["--device", "cuda", "--workers", "2"])
    assert result.exit_code == 2 and "--workers sets CPU worker processes" in result.output
    with pytest.raises(ProfileError):
        profile_gpu.profile_gpu_cluster()
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(key, value)  # as torchrun starts a process
    result = CliRunner().invoke(profile_command, ["--device", "cpu"])
    assert result.exit_code == 2 and "run it without torchrun" in result.output
