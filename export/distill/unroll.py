"""Training-time test (EAGLE-3, Li et al. 2025): train a feature draft on what it reads when
it drafts several tokens, by unrolling its drafting steps in training.

Drafting from a verified position r0, the draft's first step reads the target's features
f_<=r0; its second step reads those and its own prediction f^_{r0+1}; its k-th step, its
own predictions f^_{r0+1} .. f^_{r0+k-1} after the target's (runtime/drafting/feature.py
keeps pairs built on predictions only until verification). Unrolled step j (0-based) of
training makes the same prediction at every position r at once, with r0 = r - j:

    input of pair r:   g^(j)_r = fc([embed(x_{r+1}); f^(j)_r]),
                       f^(0)_r = f_r (the target's), f^(j)_r = out^(j-1)_{r-1} (j >= 1)
    pair r attends to: step 0's pairs s <= r - j (built on the target's features),
                       and step i's pair r - j + i for i = 1 .. j (built on predictions),

as in drafting, where pair r0 + i of the cache was computed by the i-th draft step. Each step's
keys and values are kept (`_StepKeys`), and `step_mask` says which of them a step's queries
read. Position ids stay r, so the rotary embedding is drafting's too. The tokens are the
target's answer tokens: a draft token matters only where its predecessors were accepted,
which greedy acceptance means equal to the target's.

Shapes: ids [B, L], features [B, L, H]; each step's output [B, L, H]; the mask of step j
[L, (j + 1) L], over the keys of steps 0 .. j side by side.
"""

from __future__ import annotations

import torch


def step_mask(length: int, step: int) -> torch.Tensor:
    """bool [length, (step + 1) * length]: whether query r of unrolled step `step` reads key
    s of step i (column i * length + s): i = 0 and s <= r - step, or i >= 1 and
    s == r - step + i."""
    r = torch.arange(length).unsqueeze(1)
    s = torch.arange(length).unsqueeze(0)
    blocks = [s <= r - step] + [s == r - step + i for i in range(1, step + 1)]
    return torch.cat(blocks, dim=1)


class _StepKeys:
    """The draft layer's keys and values of the steps so far, step after step along the key
    axis: given as the layer's cache, its attention reads them all (masked by `step_mask`)
    and adds its own step's."""

    def __init__(self):
        self.k = self.v = None

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, **kwargs):
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


def unrolled_predictions(draft, ids: torch.Tensor, features: torch.Tensor,
                         steps: int) -> list[torch.Tensor]:
    """[out^(0), ..., out^(steps - 1)]: out^(j)[:, r] is the draft's f^_{r+1} at its
    (j + 1)-th drafting step from r0 = r - j (module docstring). Positions r < j have no such
    r0 and hold no meaningful prediction. Step 0 is `draft.predict`."""
    if steps < 1:
        raise ValueError(f"unrolled steps must be >= 1, got {steps}")
    length = ids.shape[1]
    positions = torch.arange(length).unsqueeze(0).expand(ids.shape[0], -1)
    keys, outs, f = _StepKeys(), [], features
    for j in range(steps):
        x = draft.pairs(ids, f, positions)
        bias = torch.zeros(length, (j + 1) * length, dtype=x.dtype).masked_fill(
            ~step_mask(length, j), float("-inf"))
        out = draft.run_layer(x, positions, bias[None, None], keys)
        outs.append(out)
        # Pair r of the next step reads the prediction of f_r, made at pair r - 1.
        f = torch.cat([features[:, :1], out[:, :-1]], dim=1)
    return outs
