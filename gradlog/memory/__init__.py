"""Memory-efficient language-model heads: a linear layer and a loss, chunk by chunk over rows.

The projection of ``N`` rows of hidden states to a vocabulary of ``V`` materialises an
``(N, V)`` logits tensor, and a loss on top of it keeps one or two more of that size for its
backward (batch 4, context 4096, vocab 128K: 4 GB in bf16, 8 GB upcast to float32).
:func:`chunked_linear_loss` never holds more than one chunk of rows' logits. It calls the
caller's ``fn(x_chunk, linear, labels_chunk)`` on one chunk of rows at a time and lets autograd
differentiate it (``torch.autograd.grad`` with respect to the chunk of ``x``, the weight and the
bias); no derivative is written by hand, so cross entropy, z-loss, label smoothing,
distillation or a clipped policy-gradient objective all give the unchunked result up to float
rounding. Two schedules:

* **recompute** (always for ``reduction="none"``): forward runs ``fn`` chunk by chunk under
  ``no_grad`` and keeps only the per-row losses ``(N,)``; backward re-runs each chunk under
  autograd, in the forward's autocast and random-number state, and backpropagates that chunk's
  upstream gradient. One extra logits matmul per chunk (as activation checkpointing).
* **gradients in forward** (the default for ``"mean"``/``"sum"``): the upstream gradient of a
  scalar loss is one number, so forward already backpropagates each chunk with the rows'
  weights (1, or 1/valid-count) and keeps the gradients of ``x``, weight and bias; backward
  scales them. No recomputation: as fast as the unchunked head. It holds a weight-sized
  gradient from forward to backward, as the unchunked head's ``weight.grad`` would.

The head module itself runs every chunk (the backward through ``torch.func.functional_call``
with detached copies of its weight and bias), so module hooks see ``(rows, V)`` outputs chunk
by chunk; :func:`current_chunk` tells them which rows of ``x.shape[:-1]`` a call covers.

Example::

    from gradlog.memory import chunked_linear_loss

    def ce(x, head, y):  # (rows, d), nn.Linear, (rows,) -> (rows,)
        return F.cross_entropy(head(x).float(), y, reduction="none")

    hidden = model.body(tokens)                                    # (B, T, d)
    loss = chunked_linear_loss(hidden, model.lm_head, targets, ce)  # mean over valid tokens
    loss.backward()

    # per-datum recording: per-token losses (B, T) go to GradRecorder.backward
    losses = chunked_linear_loss(hidden, model.lm_head, targets, ce, reduction="none")
    rec.backward(losses, mask=targets != -100, datum_ids=idx)
"""

from gradlog.errors import DoubleBackwardError
from gradlog.memory.chunk import ChunkInfo, current_chunk
from gradlog.memory.head import RowLossFn, chunked_linear_loss
from gradlog.memory.peak import TensorPeak
from gradlog.memory.rows import DEFAULT_MEMORY_BUDGET_BYTES, GPU_MIN_ROWS

__all__ = [
    "DEFAULT_MEMORY_BUDGET_BYTES",
    "GPU_MIN_ROWS",
    "ChunkInfo",
    "DoubleBackwardError",
    "RowLossFn",
    "TensorPeak",
    "chunked_linear_loss",
    "current_chunk",
]
