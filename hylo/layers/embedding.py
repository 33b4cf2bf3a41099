"""``nn.Embedding`` as a Linear on one-hot inputs (docs/solvers.md, "Embeddings")."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from hylo.layers.gradmatrix import GradMatrix, GradShard
from hylo.layers.math import LayerMath
from hylo.layers.rows import OneHotRows
from hylo.layers.sharded import grad_shard, is_sharded, local, placement_problem


class EmbeddingMath(LayerMath):
    """``nn.Embedding`` as a Linear on one-hot inputs (docs/solvers.md, "Embeddings").

    s_i = Eᵀ onehot(t_i) for the token t_i at every position of the index tensor (any shape:
    (B, T), (T,), ...), so hylo's matrix is W = ``weight``ᵀ of shape (d_g, d_a) =
    (``embedding_dim``, ``num_embeddings``), a_i = onehot(t_i) and g_i = n·∂L/∂s_i over the
    n token rows of the step, exactly as for a Linear applied over leading dimensions.

    - K-FAC: A = diag(token counts)/n, built with ``bincount`` in O(n) (no one-hot product);
      it is held as a dense V×V matrix because the K-FAC family stores and decomposes dense
      factors: V² numbers per factor and an O(V³) eigendecomposition, affordable for
      vocabularies of a few thousand, not for a 50k one (the cost model charges d_a³ = V³, so
      the hybrid policy keeps large vocabularies on the low-rank path).
    - Low-rank: one factored row per token with a_i the one-hot row, held as the token's index
      (:class:`OneHotRows`: no n×V one-hot matrix), so the kernel's activation part a_iᵀ a_j is
      δ(t_i = t_j). The local kernel (KID), the row norms (KIS), the gathered kernel and the
      projection cost O(n·r·d_g), O(n·d_g), O(m²·d_g) and O(m·d_g); the apply O(m·d_g) plus the
      d_g×V result. The rows travel and are saved as the indices and g: m·(1 + d_g) numbers.
    - ``padding_idx``: torch gives the padding row a zero gradient, so padding tokens are rows
      with a_i = 0 (they count in n, like any row of a Linear whose input is zero, but add
      nothing to A, to the kernel or to the preconditioned gradient, whose padding column
      stays exactly 0). Their output gradients enter G, as a Linear's would.

    ``sparse=True`` and ``scale_grad_by_freq=True`` are refused at registration
    (:func:`unsupported_reason`); ``max_norm`` is fine (it renormalises the weight in place,
    outside autograd). The indices are integers, so the working dtype is the weight's
    (float32 at least).
    """

    #: A = diag(token counts)/n (:meth:`kfac_factors`).
    diagonal_input_factor = True

    def __init__(self, module: nn.Embedding) -> None:
        super().__init__(module)
        self.embedding = module
        self.d_g = int(module.embedding_dim)
        self.d_a = int(module.num_embeddings)

    def _tokens(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """Flat token indices and, with ``padding_idx``, which of them are not padding."""
        tokens = x.reshape(-1).to(torch.long)
        pad = self.embedding.padding_idx
        return tokens, None if pad is None else tokens != pad

    def row_counts(self, x: Tensor, grad_out: Tensor) -> tuple[int, int]:
        """Every token (every position of the index tensor, padding included) is a row for both paths;
        ``ValueError`` when the output gradient is not one ``embedding_dim`` row per index (the call was not
        a lookup of its first argument: docs/extending.md, "Subclasses")."""
        rows = x.numel()
        if grad_out.numel() != rows * self.d_g:
            raise ValueError(
                f"layer {self.name!r}: a call's output has shape {tuple(grad_out.shape)}, not one row of "
                f"{self.d_g} per index of its first argument (shape {tuple(x.shape)}): the call was not a "
                "lookup of its first argument"
            )
        return rows, rows

    def _g(self, grad_out: Tensor, scale: float) -> Tensor:
        return grad_out.reshape(-1, self.d_g).to(self.dtype) * scale

    def lowrank_rows(self, x: Tensor, grad_out: Tensor, scale: float) -> OneHotRows:
        """a_i = onehot(t_i) held as t_i (−1 for padding tokens), g_i = scale·∂L/∂s_i."""
        tokens, keep = self._tokens(x)
        marked = tokens if keep is None else torch.where(keep, tokens, -1)
        return OneHotRows(marked, self._g(grad_out, scale), self.d_a)

    def empty_rows(self) -> OneHotRows:
        """No rows, as indices (every rank's rows must have one form for the all-gather)."""
        device = self.weight.device
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return OneHotRows(empty, torch.zeros(0, self.d_g, dtype=self.dtype, device=device), self.d_a)

    def row_work(self, rows: int, kfac_rows: int) -> float:
        """Nothing beyond a copy: the rows are the indices and the output gradients."""
        return 0.0

    def kfac_factors(self, x: Tensor, grad_out: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        """Σ a aᵀ = diag(counts of each token, padding excluded) by ``bincount``; Σ g gᵀ over every token."""
        tokens, keep = self._tokens(x)
        dtype = self.dtype
        if keep is None:
            counts = torch.bincount(tokens, minlength=self.d_a).to(dtype)
        else:
            counts = torch.bincount(tokens, weights=keep.to(dtype), minlength=self.d_a).to(dtype)
        if counts.numel() != self.d_a:  # known without a host sync: bincount sized its result
            raise ValueError(
                f"layer {self.name!r}: a call's largest index is {counts.numel() - 1}, beyond the "
                f"{self.d_a} rows of the table: the call was not a lookup of its first argument"
            )
        g = self._g(grad_out, scale)
        return torch.diag(counts), self.gram(g)

    def sampled_call(self, x: Tensor, grad_out: Tensor, stride: int, offset: int) -> tuple[Tensor, Tensor] | None:
        """The tokens ≡ ``offset`` (mod ``stride``) in the flat index order and their output gradients (strided
        views); None with fewer tokens than ``stride``."""
        tokens = x.reshape(-1)
        if tokens.shape[0] < stride:
            return None
        return tokens[offset::stride], grad_out.reshape(-1, self.d_g)[offset::stride]

    def weight_grad(self) -> Tensor | None:
        """The weight's (V, D) gradient (this rank's (V_p, D) rows under FSDP2), written in place; ``ValueError``
        if it is sparse."""
        grad = local(self.weight.grad)
        if grad is not None and grad.layout != torch.strided:
            raise ValueError(
                f"layer {self.name!r}: the embedding's gradient is sparse ({grad.layout}); hylo preconditions "
                "dense gradients only: keep sparse=False on a registered nn.Embedding"
            )
        return grad

    def weight_matrix(self, weight_grad: Tensor) -> Tensor:
        """∇W = ``weight.grad``ᵀ, (d_g, d_a) = (embedding_dim, num_embeddings), a view."""
        return weight_grad.mT

    def write_weight_matrix(self, weight_grad: Tensor, matrix: Tensor) -> None:
        """Write a (d_g, d_a) matrix transposed into ``weight.grad`` in place (its dtype kept)."""
        weight_grad.copy_(matrix.mT)

    def sharding_problem(self) -> str | None:
        """None for ``fully_shard``'s layout: the weight's dim-0 shards are columns of ∇W (a slice of the vocabulary;
        docs/distributed.md, "FSDP2")."""
        weight = self.weight
        return placement_problem(weight) if is_sharded(weight) else None

    def grad_shard(self) -> GradShard | None:
        """The columns of ∇W (tokens) this rank holds under FSDP2, or None when unsharded."""
        return grad_shard(self.weight, axis=1)

    def grad_parts(self) -> GradMatrix | None:
        """∇W = ``weight.grad``ᵀ, (d_g, d_a) = (embedding_dim, num_embeddings), a view (under FSDP2 this rank's
        columns of it); None before backward."""
        self._check_shapes()
        grad = self.weight_grad()
        return None if grad is None else GradMatrix(self.weight_matrix(grad), None, self.grad_shard())

    def set_grad_matrix(self, matrix: Tensor) -> None:
        """Write a (d_g, d_a) matrix (this rank's columns under FSDP2) transposed into ``weight.grad`` in place."""
        self._check_shapes()
        grad = self.weight_grad()
        assert grad is not None
        self.write_weight_matrix(grad, matrix)
