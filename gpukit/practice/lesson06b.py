"""Lesson 06b's exercises (a small GPT): the FLOPs per token, how saved activations grow with the sequence under
fused attention, and causal attention written by hand against PyTorch's fused kernel."""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from .. import bench, memory, models
from ..env import detect
from .exercise import Exercise, Mistake, Prediction, Verdict, WrongAnswer
from .exercise import progress as _progress

LESSON = "06b_a_small_gpt_on_text"
BEFORE = "## What you can take to your own notebook"

SIZES = dict(width=64, depth=2, heads=4)  # the exercises' GPT: small, so that every check takes a moment
FLOPS_SEQ = 256


# --- 1 · predict: FLOPs per token ------------------------------------------------------------------------------


def _measure_flops_per_token() -> list[float]:
    # torch's FLOP counter over one training step (forward, loss, backward) of 2 windows of FLOPS_SEQ tokens.
    model = models.gpt(max_seq_len=FLOPS_SEQ, **SIZES)
    tokens = torch.randint(0, 256, (2, FLOPS_SEQ), generator=torch.Generator().manual_seed(0))
    return [bench.flops_per_step(model, (tokens, tokens)) / tokens.numel()]


flops_per_token = Prediction(
    key="06b.flops_per_token",
    kind="predict",
    title="a GPT's training FLOPs per token",
    prompt=f"""### Exercise 1 · Predict: FLOPs per token

`gk.models.gpt(max_seq_len={FLOPS_SEQ}, width=64, depth=2, heads=4)`: 256 byte tokens, an embedding shared with the
output head, 2 blocks of attention (q, k, v and output projections: 4·d² weights) and an MLP (d → 4d → d: 8·d²), on
windows of T = {FLOPS_SEQ} tokens. **Predict the FLOPs of one training step per token** (section 1 gives the rule).
The check counts a real step's FLOPs with torch's counter.""",
    starter="""flops_per_token_prediction = ...  # training FLOPs per token: forward and backward
""",
    answer="flops_per_token_prediction",
    solution_code=f"""width, depth, vocab, tokens = 64, 2, 256, {FLOPS_SEQ}
# Weights in matrix products: 12·d² per block, and the output head (vocab × width; the embedding it shares with is
# a lookup, no product).
matmul_weights = depth * 12 * width**2 + vocab * width
# 6 FLOPs per weight and token (2 forward, 4 backward), plus attention's scores and weighted sum: 4·T·d per layer
# forward, 12·T·d forward and backward.
flops_per_token_prediction = 6 * matmul_weights + 12 * depth * tokens * width
""",
    hints=(
        "section 1: about 6 FLOPs per weight used in a matrix product, per token, plus attention",
        "the weights in products: 12·d² per block and the output head (256 × 64); attention adds 12·L·T·d per token",
        "6 · (2 · 12 · 64² + 256 · 64) + 12 · 2 · 256 · 64",
    ),
    wrong_answers=(
        WrongAnswer("flops_per_token_prediction = 6 * (2 * 12 * 64**2 + 256 * 64)", "attention's scores"),
        WrongAnswer(
            "flops_per_token_prediction = 2 * (6 * (2 * 12 * 64**2 + 256 * 64) + 12 * 2 * 256 * 64)",
            "twice the counted",
        ),
        WrongAnswer(
            "flops_per_token_prediction = 2 * (2 * 12 * 64**2 + 256 * 64) + 4 * 2 * 256 * 64", "the forward pass only"
        ),
    ),
    measure=_measure_flops_per_token,
    what="the counted FLOPs per token",
    unit=" FLOP",
    floor=0.1,  # the rule leaves out LayerNorms, softmax and the loss
    mistakes=(
        Mistake(
            (6 * (2 * 12 * 64**2 + 256 * 64)) / (6 * (2 * 12 * 64**2 + 256 * 64) + 12 * 2 * 256 * 64),
            "too low by about attention's scores and weighted sum: add 12·L·T·d per token, which grows with T",
        ),
        Mistake(2.0, "twice the counted: 6 FLOPs per weight and token (2 forward, 4 backward), not 12"),
        Mistake(1 / 3, "a third: the forward pass only; the backward costs twice the forward"),
        Mistake(0.5, "half: did you count one FLOP per multiply-add (it is 2)?"),
    ),
)


# --- 2 · predict: saved bytes against the sequence length -------------------------------------------------------


def _measure_saved_growth() -> list[float]:
    # Saved-tensor hooks on a real forward pass and loss (gk.memory.saved_bytes), fused attention, T and 4T.
    saved = []
    for length in (64, 256):
        tokens = torch.randint(0, 256, (4, length), generator=torch.Generator().manual_seed(0))
        saved.append(memory.saved_bytes(models.gpt(max_seq_len=256, **SIZES), (tokens, tokens), device=detect().device))
    return [saved[1] / saved[0]]


saved_growth = Prediction(
    key="06b.saved_growth",
    kind="predict",
    title="how a GPT's saved activations grow with the sequence",
    prompt="""### Exercise 2 · Predict: four times the sequence

The exercises' GPT (width 64, 2 blocks, fused attention `F.scaled_dot_product_attention`, as `gk.models.gpt` builds
it) on 4 windows of 64 tokens, then of 256. **Predict how many times more bytes its forward pass saves for the
backward pass at 256 tokens than at 64** (section 4). The check measures both with saved-tensor hooks.""",
    starter="""growth_prediction = ...  # saved bytes at T = 256 ÷ saved bytes at T = 64, fused attention
""",
    answer="growth_prediction",
    solution_code="""# Every layer saves tensors of (B, T, d) or (B, T, 4d); the fused attention keeps (B, heads, T) statistics, not
# the (B, heads, T, T) matrix a hand-written attention keeps: everything grows in proportion to T.
growth_prediction = 256 / 64
""",
    hints=(
        "which saved tensors grow with T, and which with T²?",
        "fused attention keeps only (B, heads, T) statistics for its backward; the (T, T) matrix is never stored",
        "everything saved grows linearly with T: 256 / 64",
    ),
    wrong_answers=(
        WrongAnswer("growth_prediction = (256 / 64) ** 2", "(B, heads, T, T)"),
        WrongAnswer("growth_prediction = 2 * 256 / 64", "twice the measured"),
        WrongAnswer("growth_prediction = 256 / 64 / 2", "half the measured"),
    ),
    measure=_measure_saved_growth,
    what="the measured ratio",
    unit="x",
    floor=0.05,
    mistakes=(
        Mistake(
            4.0,
            "16x is T²: that is the (B, heads, T, T) matrix a hand-written attention saves; the fused "
            "kernel keeps (B, heads, T) statistics, so every saved tensor grows linearly with T",
        ),
        Mistake(2.0, "twice the measured: every saved tensor is (B, T, …): 4x the tokens, 4x the bytes"),
        Mistake(0.5, "half the measured: the bytes grow in proportion to the tokens"),
    ),
)


# --- 3 · build it: causal attention by hand -----------------------------------------------------------------------


def _variants(q, k, v) -> dict[str, torch.Tensor]:
    """The usual slips of causal attention written by hand, to name the one an answer made."""
    scores = q @ k.transpose(-2, -1)
    length = q.shape[-2]
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    masked = lambda s, mask: s.masked_fill(~mask, float("-inf"))  # noqa: E731
    return {
        "without the 1/√d scale": torch.softmax(masked(scores, causal), -1) @ v,
        "without the causal mask": torch.softmax(scores / math.sqrt(q.shape[-1]), -1) @ v,
        "with the mask the wrong way round": torch.softmax(masked(scores / math.sqrt(q.shape[-1]), causal.T), -1) @ v,
        "with softmax over the queries (dim -2)": torch.softmax(masked(scores / math.sqrt(q.shape[-1]), causal), -2)
        @ v,
    }


_FIXES = {
    "without the 1/√d scale": "divide the scores q·kᵀ by √d (d: the head's width) before the softmax",
    "without the causal mask": "a token must not see later tokens: set the scores above the diagonal to -inf",
    "with the mask the wrong way round": "keep the scores on and below the diagonal (tril): a token sees itself and "
    "earlier tokens",
    "with softmax over the queries (dim -2)": "each query's weights over the keys must sum to 1: softmax over the "
    "last dimension",
}


def _judge_attention(causal_attention) -> Verdict:
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=generator).to(detect().device) for _ in range(3))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    got = causal_attention(q, k, v)
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return Verdict(
            False,
            f"causal_attention(q, k, v) must return a tensor of shape {tuple(expected.shape)} (B, "
            f"heads, T, d), got {getattr(got, 'shape', type(got).__name__)}",
        )
    error = (got - expected).abs().max().item()
    shown = f"your output differs from F.scaled_dot_product_attention(is_causal=True) by {error:.2g} (allowed 1e-5)"
    if error <= 1e-5:
        return Verdict(True, shown)
    for slip, output in _variants(q, k, v).items():
        if (got - output).abs().max().item() <= 1e-5:
            return Verdict(False, f"{shown}: it matches attention {slip}: {_FIXES[slip]}")
    return Verdict(False, f"{shown}: softmax(q·kᵀ/√d, masked above the diagonal) · v")


attention_by_hand = Exercise(
    key="06b.attention_by_hand",
    kind="build",
    title="causal attention by hand, against the fused kernel",
    prompt="""### Exercise 3 · Build it: causal attention

Write `causal_attention(q, k, v)` for tensors of shape (B, heads, T, d): each position's output is the average of
the values of itself and the positions before it, weighted by the softmax of its query's scaled dot products with
their keys (section 4's hand-written attention; `gk.models.gpt(..., attention="manual")` has one). Use plain tensor
operations, not `F.scaled_dot_product_attention`: the check compares yours with it.""",
    starter="""def causal_attention(q, k, v):
    ...  # (B, heads, T, d) -> (B, heads, T, d): softmax(q·kᵀ/√d) over earlier keys, times v
""",
    answer="causal_attention",
    solution_code="""import math


def causal_attention(q, k, v):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, heads, T, T): query i against key j
    length = q.shape[-2]
    sees = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()  # j <= i: itself and before
    scores = scores.masked_fill(~sees, float("-inf"))  # softmax gives later keys a weight of 0
    return torch.softmax(scores, dim=-1) @ v  # each query's weights over the keys sum to 1
""",
    hints=(
        "scores = q @ k.transpose(-2, -1), one row per query and one column per key; softmax, then @ v",
        "scale the scores by 1/√d; mask the keys after each query (above the diagonal) with -inf before the softmax",
        "torch.ones(T, T, dtype=torch.bool).tril() is True where a query may see a key; scores.masked_fill(~mask, -inf)",
    ),
    wrong_answers=(
        WrongAnswer(
            """def causal_attention(q, k, v):
    scores = q @ k.transpose(-2, -1)
    mask = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool, device=q.device).tril()
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v
""",
            "divide the scores q·kᵀ by √d",
        ),
        WrongAnswer(
            """import math


def causal_attention(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v
""",
            "set the scores above the diagonal to -inf",
        ),
        WrongAnswer(
            """import math


def causal_attention(q, k, v):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    mask = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool, device=q.device).triu()
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v
""",
            "keep the scores on and below the diagonal",
        ),
    ),
    judge=_judge_attention,
)


EXERCISES = (flops_per_token, saved_growth, attention_by_hand)


def progress() -> None:
    """This lesson's exercises and what their last check said in this kernel."""
    _progress(EXERCISES)
