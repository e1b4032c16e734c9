"""SUMMA matrix products on the q x q Optimus grid (arXiv 2104.05343, section 3).

Every matrix is cut into q x q blocks; rank (i, j) holds block (i, j) of each operand and of
the result. Three products cover a linear layer's forward and backward:

    ab :  C = A B      C_ij = sum_k A_ik B_kj     step k: A_ik along row i, B_kj along column j
    abt:  C = A B^T    C_il = sum_j A_ij B_lj^T   step l: B_lj along column j; the partial
                                                  A_ij B_lj^T is reduced along row i to (i, l)
    atb:  C = A^T B    C_lj = sum_i A_il^T B_ij   step l: A_il along row i; the partial
                                                  A_il^T B_ij is reduced along column j to (l, j)

Each step moves one block, so a rank holds one borrowed block at a time, never a whole row or
column: this is why activation memory falls with q. Per product a rank sends or receives
q blocks of each broadcast operand (a broadcast tree inside the row or column).

The grid's row and column groups come from comm.Grid; this file has no process groups.
"""

from __future__ import annotations

import torch

from tessera.parallel.tensor.comm import Grid


def _borrow(block: torch.Tensor, owner_is_me: bool) -> torch.Tensor:
    # The owner sends its own block; the others receive into a fresh buffer.
    if owner_is_me:
        return block.contiguous()
    return torch.empty_like(block, memory_format=torch.contiguous_format)


def summa_ab(a: torch.Tensor, b: torch.Tensor, grid: Grid) -> torch.Tensor:
    """Block (i, j) of A B; ``a`` is A_ij (m, k/q), ``b`` is B_ij (k/q, n/q)."""
    out = None
    for k in range(grid.q):
        a_k = grid.row.broadcast(_borrow(a, grid.j == k), src=k)  # A_ik (m, k/q)
        b_k = grid.col.broadcast(_borrow(b, grid.i == k), src=k)  # B_kj (k/q, n/q)
        out = a_k @ b_k if out is None else out.addmm_(a_k, b_k)
    return out  # (m, n/q)


def summa_abt(a: torch.Tensor, b: torch.Tensor, grid: Grid) -> torch.Tensor:
    """Block (i, j) of A B^T; ``a`` is A_ij (m, k/q), ``b`` is B_ij (n/q, k/q)."""
    out = None
    for l in range(grid.q):
        b_l = grid.col.broadcast(_borrow(b, grid.i == l), src=l)  # B_lj (n/q, k/q)
        part = a @ b_l.t()  # (m, n/q): this rank's term of C_il
        grid.row.reduce(part, dst=l)
        if grid.j == l:
            out = part
    return out


def summa_atb(a: torch.Tensor, b: torch.Tensor, grid: Grid) -> torch.Tensor:
    """Block (i, j) of A^T B; ``a`` is A_ij (m, p/q), ``b`` is B_ij (m, n/q)."""
    out = None
    for l in range(grid.q):
        a_l = grid.row.broadcast(_borrow(a, grid.j == l), src=l)  # A_il (m, p/q)
        part = a_l.t() @ b  # (p/q, n/q): this rank's term of C_lj
        grid.col.reduce(part, dst=l)
        if grid.i == l:
            out = part
    return out
