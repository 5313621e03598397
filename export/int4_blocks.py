"""4-bit weights with integer zero points, chosen per block by a search, in the layout of
ONNX Runtime's MatMulNBits.

A block is BLOCK consecutive weights along the reduction axis K of a [K, N] weight, stored
as w = s * (q - z): a float scale s, an integer zero point z in [0, 15] and 4-bit codes q.
ONNX Runtime's fast CPU kernels (accuracy_level 4: int8 activations) take exactly this form,
so a graph needs nothing but the MatMulNBits node. min/max rounding (s = range / 15, z the
rounded offset) wastes part of the grid on most blocks; the search tries scales around it,
places the zero point for each, refits the scale by least squares to the codes it chose, and
keeps the one with the smallest squared error per block (the idea of llama.cpp's k-quants,
with the zero point held to an integer).

Shapes: w [K, N]; codes [K, N] uint8; scales and zero points [K / BLOCK, N].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Scale candidates: range / (15 + step) for these steps; 0 is min/max rounding.
SCALE_STEPS = np.arange(-2.0, 4.01, 0.25)


@dataclass(frozen=True)
class Int4Blocks:
    """A [K, N] weight as 4-bit codes, with one scale and integer zero point per block."""

    codes: np.ndarray        # [K, N] uint8 in [0, 15]
    scales: np.ndarray       # [K / block, N] float32
    zero_points: np.ndarray  # [K / block, N] uint8 in [0, 15]
    block: int

    def dequantized(self) -> np.ndarray:
        """w' [K, N] float32 = s * (q - z), what the kernels compute with."""
        k, n = self.codes.shape
        q = self.codes.reshape(k // self.block, self.block, n).astype(np.float32)
        z = self.zero_points[:, None, :].astype(np.float32)
        return (self.scales[:, None, :] * (q - z)).reshape(k, n)


def _codes(blocks: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
    """Nearest codes of `blocks` [B, block, N] on the grids s * (q - z) (s > 0)."""
    return np.clip(np.rint(blocks / scale[:, None, :]) + zero[:, None, :], 0, 15)


def search_int4(weight: np.ndarray, block: int = 32,
                importance: np.ndarray | None = None) -> Int4Blocks:
    """The per-block scale and integer zero point (module docstring) with the smallest
    squared error over SCALE_STEPS, each as found and refit by least squares to its codes.

    `importance` [K]: how much an error on each input channel costs, e.g. the mean square of
    the activations that multiply it (the error of x @ W is sum_k x_k e_k): the errors are
    weighted by it. None weighs every channel alike."""
    k, n = weight.shape
    if k % block:
        raise ValueError(f"the reduction axis ({k}) must be a multiple of the block ({block})")
    blocks = weight.astype(np.float32).reshape(k // block, block, n)
    if importance is None:
        weights = np.ones((k // block, block, 1), np.float32)
    else:
        weights = np.asarray(importance, np.float32).reshape(k // block, block, 1)
        weights = weights / np.maximum(weights.mean(axis=1, keepdims=True), 1e-30) + 1e-3
    low = np.minimum(blocks.min(axis=1), 0.0)
    high = np.maximum(blocks.max(axis=1), 0.0)
    span = np.where(high > low, high - low, 1.0)
    best_err = np.full(low.shape, np.inf, np.float32)
    best_scale = span / 15
    best_zero = np.zeros(low.shape, np.float32)
    for step in SCALE_STEPS:
        scale = span / (15 + step)
        zero = np.clip(np.rint(-low / scale), 0, 15)
        q = _codes(blocks, scale, zero) - zero[:, None, :]
        # Weighted least-squares scale for these codes:
        # argmin_s sum a (w - s c)^2 = sum a w c / sum a c^2.
        denom = (weights * q * q).sum(axis=1)
        fit = np.where(denom > 0, (weights * blocks * q).sum(axis=1) / np.maximum(denom, 1e-30),
                       scale)
        fit = np.where(fit > 0, fit, scale)
        # The candidate as found and as refit (a refit moves codes, rarely for the worse).
        for s in (scale, fit):
            q = _codes(blocks, s, zero) - zero[:, None, :]
            err = (weights * (blocks - s[:, None, :] * q) ** 2).sum(axis=1)
            better = err < best_err
            best_err = np.where(better, err, best_err)
            best_scale = np.where(better, s, best_scale)
            best_zero = np.where(better, zero, best_zero)
    codes = _codes(blocks, best_scale, best_zero).astype(np.uint8).reshape(k, n)
    return Int4Blocks(codes, best_scale.astype(np.float32), best_zero.astype(np.uint8), block)


def matmul_nbits_arrays(q: Int4Blocks) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MatMulNBits' B, scales and zero_points inputs for `q` (bits 4, block_size q.block):
    B [N, K / block, block / 2] uint8, two codes a byte along K, the first in the low
    nibble; scales [N * K / block]; zero points [N * ceil((K / block) / 2)] uint8, two
    blocks a byte, the first in the low nibble."""
    k, n = q.codes.shape
    blocks = k // q.block
    codes = q.codes.T.reshape(n, blocks, q.block // 2, 2)
    packed = (codes[..., 0] | (codes[..., 1] << 4)).astype(np.uint8)
    zero = q.zero_points.T  # [N, blocks]
    if blocks % 2:
        zero = np.concatenate([zero, np.zeros((n, 1), np.uint8)], axis=1)
    zero = zero.reshape(n, -1, 2)
    zero_packed = (zero[..., 0] | (zero[..., 1] << 4)).astype(np.uint8).reshape(-1)
    return packed, np.ascontiguousarray(q.scales.T).reshape(-1), zero_packed
