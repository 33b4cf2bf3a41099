"""``nn.ConvTranspose2d`` and ``nn.ConvTranspose1d`` with groups == 1, as the convolutions they are.

docs/solvers.md, "Transposed convolutions": a transposed convolution is a convolution, with
stride 1 and the module's dilation, over its input with ``stride − 1`` zeros inserted between
neighbours and ``dilation·(k − 1) − padding`` padded on each side (``output_padding`` more at the
end), by the kernel flipped in space with input and output channels swapped. hylo's W is that
convolution's weight, so every row mode, the KFC factors and the chunking are Conv2d's
(:class:`~hylo.layers.conv.ConvMath`) and the bias is W's last column as for any convolution.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from hylo.layers.conv import DEFAULT_KFC_EXPONENT, DEFAULT_MAX_UNFOLD_MB, ConvMath, ConvRows, plane


class ConvTransposeMath(ConvMath):
    """``nn.ConvTranspose2d`` / ``nn.ConvTranspose1d`` with groups == 1 (stride, padding, output padding
    or ``output_size``, dilation, with or without bias, batched or unbatched input).

    The equivalent convolution (module docstring) has W[o, (c, k)] = ``weight``[c, o, K − 1 − k]
    (d_g = C_out, d_a = C_in·Π k + bias) and reads the zero-inserted, padded input at the output's
    L positions: its patches are C_in·Π k numbers at each of stride^d times more positions than the
    input has (d the spatial dimensions), most of them zeros. The output padding is read from each
    call's output gradient, so a forward given ``output_size`` is covered.

    ∇W's weight part is the weight's gradient transposed and flipped: one copy when an update reads
    it and one when it writes the preconditioned gradient back (:meth:`weight_matrix`,
    :meth:`write_weight_matrix`).
    """

    def __init__(
        self,
        module: nn.ConvTranspose1d | nn.ConvTranspose2d,
        rows: ConvRows = "sum",
        kfc_exponent: float = DEFAULT_KFC_EXPONENT,
        max_unfold_mb: float = DEFAULT_MAX_UNFOLD_MB,
    ) -> None:
        super().__init__(module, rows, kfc_exponent, max_unfold_mb)
        weight = module.weight
        self.d_g = int(weight.shape[1])
        self.d_a = int(weight.shape[0] * weight[0, 0].numel()) + (1 if self.bias is not None else 0)
        #: The equivalent convolution slides one position at a time over the zero-inserted input.
        self.stride = (1, 1)
        #: The zeros' spacing: the module's stride (in 2-D form).
        self.spacing = plane(module.stride)
        padding = module.padding
        assert not isinstance(padding, str)  # a transposed convolution's padding is numbers
        self.padding = (0, padding[0]) if self.spatial == 1 else (padding[0], padding[1])

    sums_from_input = False

    def _padded(self, x: Tensor, out_hw: tuple[int, int]) -> Tensor:
        """``x`` (N, C, H, W) with stride − 1 zeros between neighbours, padded (or cropped) to give ``out_hw``."""
        sh, sw = self.spacing
        n, c, h, w = x.shape
        spread = x
        if (sh, sw) != (1, 1):
            spread = x.new_zeros(n, c, (h - 1) * sh + 1, (w - 1) * sw + 1)
            spread[:, :, ::sh, ::sw] = x
        flat: list[int] = []
        for side in (1, 0):  # F.pad lists the last dimension first
            k, d, out = self.kernel_size[side], self.dilation[side], out_hw[side]
            before = d * (k - 1) - self.padding[side]
            flat += [before, out + d * (k - 1) - spread.shape[2 + side] - before]
        return F.pad(spread, flat)

    def weight_matrix(self, weight_grad: Tensor) -> Tensor:
        """``weight_grad`` (C_in, C_out, *k) as the equivalent convolution's (C_out, C_in·Π k): a copy."""
        spatial = tuple(range(2, weight_grad.dim()))
        return weight_grad.transpose(0, 1).flip(spatial).reshape(self.d_g, -1)

    def write_weight_matrix(self, weight_grad: Tensor, matrix: Tensor) -> None:
        """Write the equivalent convolution's (C_out, C_in·Π k) ``matrix`` into ``weight_grad`` (C_in, C_out, *k)."""
        shape = (self.d_g, weight_grad.shape[0], *weight_grad.shape[2:])
        spatial = tuple(range(2, weight_grad.dim()))
        weight_grad.copy_(matrix.reshape(shape).flip(spatial).transpose(0, 1))
