"""SavedPeak: the peak of what autograd saves, the measure behind schedule memory figures."""

import torch
from torch.utils.checkpoint import checkpoint

from tessera.memory.saved_peak import SavedPeak


def _chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    for _ in range(4):
        x = torch.tanh(x @ w)  # saves x (input of @) and the tanh output
    return x


def test_peak_counts_saved_storages_once_and_frees_them_after_backward():
    w = torch.nn.Parameter(torch.randn(64, 64))
    x = torch.randn(32, 64)
    probe = SavedPeak([w])
    with probe:
        out = _chain(x, w)
        # x, then each tanh output is saved twice (by tanh and by the next @): 5 storages
        assert probe.live == 5 * 32 * 64 * 4
        out.sum().backward()
    del out
    assert probe.peak == 5 * 32 * 64 * 4 and probe.live == 0


def test_checkpointing_lowers_the_peak():
    w = torch.nn.Parameter(torch.randn(64, 64))
    x = torch.randn(32, 64, requires_grad=True)
    plain, ckpt = SavedPeak([w]), SavedPeak([w])
    with plain:
        _chain(x, w).sum().backward()
    with ckpt:
        out = checkpoint(_chain, x, w, use_reentrant=False)
        assert ckpt.live < plain.peak  # only the checkpoint's inputs are saved until backward
        out.sum().backward()
    assert ckpt.peak <= plain.peak
