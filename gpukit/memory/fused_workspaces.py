"""Workspaces that fused kernels keep for backward, which fake tensors do not see.

PyTorch's LSTM on a CPU runs oneDNN's fused kernel (`aten.mkldnn_rnn_layer`, one call per layer and
direction), which returns a workspace of bytes that backward needs: the gates, hidden and cell states
and gradient buffers of every time step. Its fake (meta) implementation returns an empty workspace, so a
prediction on fake tensors missed most of an LSTM's saved memory (62% and 68% of the step's measured peak at
hidden 32 × 12 steps and hidden 128 × 64 steps, batch 16).
`FusedWorkspaces` gives the fake kernel a workspace of the size oneDNN allocates.

The size follows oneDNN v3's CPU RNN (src/cpu/rnn/rnn_utils.hpp, `set_rnn_conf` and `set_offsets` in
rnn_utils.cpp): eight buffers, each starting on a 4 KiB page, whose leading dimensions are padded to 64
bytes and kept off multiples of 256 elements. It equals the workspace the real kernel returned for every
shape tried (batch 1-64, 1-64 time steps, hidden 8-256, input 8-300, float32).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_PAGE = 4096  # bytes: oneDNN starts each buffer of the workspace on a page
_ACCUMULATOR = 4  # bytes: float32, what oneDNN accumulates gradients in


def _good_leading_dimension(elements: int, element_size: int) -> int:
    """oneDNN's `get_good_ld`: rows padded to 64 bytes, and never a multiple of 256 elements (4K aliasing)."""
    per_line = 64 // element_size
    padded = -(-elements // per_line) * per_line
    return padded + per_line if padded % 256 == 0 else padded


def onednn_lstm_workspace_bytes(
    steps: int, batch: int, input_size: int, hidden_size: int, element_size: int = 4, cell_size: int = 4
) -> int:
    """Bytes of the workspace oneDNN keeps for backward of one LSTM layer in one direction, in training.

    element_size: bytes per element of the input (4 for float32, 2 for bfloat16); cell_size: of the cell state.
    """
    states = 2 * (steps + 1) * batch  # (layers + 1) × (steps + 1) rows of states, for one layer
    widest = max(input_size, hidden_size)
    buffers = [
        steps * batch * _good_leading_dimension(4 * hidden_size, element_size) * element_size,  # gates
        steps * batch * _good_leading_dimension(hidden_size, element_size) * element_size,  # hidden outputs
        states * _good_leading_dimension(widest, element_size) * element_size,  # layer (and iteration) states
        states * hidden_size * cell_size,  # cell states
        states * _good_leading_dimension(widest, _ACCUMULATOR) * _ACCUMULATOR,  # gradients of layer states
        states * _good_leading_dimension(widest, _ACCUMULATOR) * _ACCUMULATOR,  # gradients of iteration states
        states * hidden_size * _ACCUMULATOR,  # gradients of cell states
    ]
    offset = 0
    for size in buffers:
        offset = -(-offset // _PAGE) * _PAGE + size
    return -(-offset // _PAGE) * _PAGE  # the eighth buffer (GRU-LBR only) is empty, but starts on a page


class FusedWorkspaces(TorchDispatchMode):
    """Inside a FakeTensorMode: fused kernels' workspaces get the size the real kernels allocate."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.mkldnn_rnn_layer.default:
            out = self._lstm_workspace(args, out)
        return out

    @staticmethod
    def _lstm_workspace(args, out):
        # mkldnn_rnn_layer(input, weights ×4, hx, cx, reverse, batch_sizes, mode, hidden_size, num_layers,
        # has_biases, bidirectional, batch_first, train): the input is always (steps, batch, features).
        inputs, cell, hidden_size, train = args[0], args[6], args[10], args[15]
        if not train:
            return out
        steps, batch, features = inputs.shape
        cell_size = cell.element_size() if isinstance(cell, torch.Tensor) else inputs.element_size()
        size = onednn_lstm_workspace_bytes(steps, batch, features, hidden_size, inputs.element_size(), cell_size)
        workspace = torch.empty(size, dtype=torch.uint8, device=inputs.device)  # fake: made under the FakeTensorMode
        return (*out[:3], workspace)
