"""Small CNNs for 32×32 images, used by the lessons.

Both accept channels_last input: convert with `model.to(memory_format=torch.channels_last)`.

And a small GPT (a decoder-only transformer) for the text lessons: `gpt()`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .validation import check_int

__all__ = [
    "ATTENTIONS",
    "GPT",
    "POSITIONS",
    "FastCNN",
    "count_parameters",
    "fast_cnn",
    "gpt",
    "linear_classifier",
    "manual_attention",
    "resnet18",
]


def conv_bn(in_channels: int, out_channels: int) -> nn.Sequential:
    """3×3 convolution → BatchNorm → GELU. The conv has no bias: BatchNorm's shift replaces it."""
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.GELU(),
    )


class ConvGroup(nn.Sequential):
    """conv_bn → 2×2 max-pool (halves H and W) → conv_bn: one stage of the fast CNN."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__(conv_bn(in_channels, out_channels), nn.MaxPool2d(2), conv_bn(out_channels, out_channels))


class FastCNN(nn.Sequential):
    """The airbench family of fast CIFAR-10 networks: a stem and three conv groups.

    Shapes for a (B, 3, 32, 32) input and width w:
    stem (B, w, 32, 32) → (B, 2w, 16, 16) → (B, 4w, 8, 8) → (B, 4w, 4, 4) → max over space
    (B, 4w) → linear (B, classes). The logits are scaled down, as in airbench, which keeps
    the softmax from saturating early; ×1/2 learned fastest with SGD at lr 0.1 for batch 64
    on the shapes dataset (airbench's ×1/8 goes with its much larger learning rate).
    """

    def __init__(self, width: int = 64, num_classes: int = 10, logit_scale: float = 0.5):
        if width <= 0 or num_classes <= 0:
            raise ValueError(f"width and num_classes must be positive, got {width} and {num_classes}.")
        super().__init__(
            conv_bn(3, width),
            ConvGroup(width, 2 * width),
            ConvGroup(2 * width, 4 * width),
            ConvGroup(4 * width, 4 * width),
            nn.AdaptiveMaxPool2d(1),
            nn.Flatten(),
            nn.Linear(4 * width, num_classes, bias=False),
        )
        self.logit_scale = logit_scale

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return super().forward(images) * self.logit_scale


def fast_cnn(width: int = 64, num_classes: int = 10) -> FastCNN:
    """The kit's fast CNN (about 1.9 M parameters at width 64, 0.12 M at width 16)."""
    return FastCNN(width, num_classes)


def resnet18(num_classes: int = 10) -> nn.Module:
    """torchvision's ResNet-18 adapted to 32×32 images, as in CIFAR papers.

    The 7×7 stride-2 stem and the max-pool would shrink a 32×32 image to 8×8 before the
    first block; a 3×3 stride-1 stem without the pool keeps 32×32, as in the CIFAR ResNets.
    """
    import torchvision

    model = torchvision.models.resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(3, 64, 3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def linear_classifier(num_classes: int = 10, image_shape=(3, 32, 32)) -> nn.Module:
    """Logistic regression on raw pixels: the baseline the shapes dataset must defeat."""
    channels, height, width = image_shape
    return nn.Sequential(nn.Flatten(), nn.Linear(channels * height * width, num_classes))


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# A small GPT ------------------------------------------------------------------------------------------------------

POSITIONS = ("learned", "rotary")


def rotary_tables(max_seq_len: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each (max_seq_len, head_dim / 2), in float32.

    Pair i of a head's features turns by angle position × base^(-2i / head_dim): fast turns for
    the first pairs, slow ones for the last, like the sinusoids of the original transformer.
    """
    frequencies = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)  # (head_dim / 2,)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), frequencies)  # (max_seq_len, head_dim / 2)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, heads, T, head_dim) queries or keys by their position; cos and sin are (T, head_dim / 2).

    The first and second halves of the features form the pairs that turn (the GPT-NeoX and Llama
    layout). A query at position m and a key at position n then score by their offset m - n
    alone, which is how the model learns relative positions without a position embedding.
    The rotation runs in float32 and returns x's dtype: attention needs q, k and v of one dtype,
    and a model converted with .to(torch.bfloat16) would otherwise pass float32 q and k.
    """
    first, second = x.float().chunk(2, dim=-1)
    rotated = torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)
    return rotated.type_as(x)


ATTENTIONS = ("sdpa", "manual")


def manual_attention(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, dropout: float = 0.0
) -> torch.Tensor:
    """Causal attention written out, as a transformer tutorial writes it: softmax(q·kᵀ / √head_dim) · v.

    queries, keys, values (B, heads, T, head_dim) → (B, heads, T, head_dim). It builds the (B, heads, T, T)
    matrix of scores, and autograd keeps the softmax's weights, of that shape, for backward: memory that grows
    with T². F.scaled_dot_product_attention computes the same result without keeping that matrix.
    """
    length = queries.shape[-2]
    scores = queries @ keys.transpose(-2, -1) / math.sqrt(queries.shape[-1])  # (B, heads, T, T)
    future = torch.ones(length, length, dtype=torch.bool, device=queries.device).triu(1)  # key after the query
    weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)  # (B, heads, T, T), kept for backward
    if dropout:
        weights = F.dropout(weights, dropout)
    return weights @ values


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position t sees positions 0…t only.

    (B, T, width) → queries, keys, values (B, heads, T, width / heads) → attention → (B, T, width).
    attention="sdpa": F.scaled_dot_product_attention picks the fastest kernel the device has (flash
    attention on recent GPUs), and is_causal=True masks the future without building a (T, T) mask.
    attention="manual": `manual_attention`, the same result written out, which keeps a (B, heads, T, T)
    matrix for backward (lesson 06 measures what that costs).
    """

    def __init__(self, width: int, heads: int, dropout: float, attention: str = "sdpa"):
        if attention not in ATTENTIONS:
            raise ValueError(
                f"attention must be one of {', '.join(map(repr, ATTENTIONS))}, got {attention!r}: 'sdpa' is "
                "F.scaled_dot_product_attention, 'manual' the same softmax(q·kᵀ/√d)·v written out."
            )
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.attention = attention
        self.qkv = nn.Linear(width, 3 * width, bias=False)  # one matmul for queries, keys and values
        self.out = nn.Linear(width, width, bias=False)
        self.out_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        batch_size, length, width = x.shape
        # (B, T, 3·width) → (3, B, heads, T, head_dim): one tensor each for queries, keys and values.
        queries, keys, values = self.qkv(x).view(batch_size, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if rotary is not None:
            queries, keys = apply_rotary(queries, *rotary), apply_rotary(keys, *rotary)
        dropout = self.dropout if self.training else 0.0
        if self.attention == "sdpa":
            attended = F.scaled_dot_product_attention(queries, keys, values, dropout_p=dropout, is_causal=True)
        else:
            attended = manual_attention(queries, keys, values, dropout)  # (B, heads, T, head_dim)
        return self.out_dropout(self.out(attended.transpose(1, 2).reshape(batch_size, length, width)))


class Block(nn.Module):
    """One transformer layer, pre-norm: x + attention(norm(x)), then x + mlp(norm(x)). (B, T, width) → same.

    Normalising each branch's input (pre-norm, as in GPT-2) leaves the residual stream an
    identity path from the embedding to the output, so gradients reach every layer unscaled
    and training is stable without the long learning-rate warm-up that post-norm needs.
    """

    def __init__(self, width: int, heads: int, mlp_ratio: float, dropout: float, attention: str = "sdpa"):
        super().__init__()
        hidden = int(mlp_ratio * width)
        self.attention_norm = nn.LayerNorm(width)
        self.attention = CausalSelfAttention(width, heads, dropout, attention)
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, hidden, bias=False), nn.GELU(), nn.Linear(hidden, width, bias=False), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rotary)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """A decoder-only transformer (GPT-2's layout, small): token ids (B, T) → next-token logits (B, T, vocab_size).

    token embedding (B, T, width) [+ learned position embedding] → `depth` pre-norm blocks in
    `self.blocks` (an nn.ModuleList, so gk.memory.find_blocks finds them) → final LayerNorm → head
    (B, T, vocab_size). Logits at position t depend on tokens 0…t only.

    The head shares its weight with the token embedding (weight tying): it saves vocab_size ×
    width parameters, most of a small model's, and the embedding then learns from every
    position's output as well as from its input, which helps small models on little data.
    positions="learned" adds an embedding of each position 0…max_seq_len-1; "rotary" (RoPE)
    rotates queries and keys by their position instead, which encodes relative offsets.
    attention="sdpa" runs F.scaled_dot_product_attention; "manual" the same softmax(q·kᵀ/√d)·v written
    out, which keeps each block's (B, heads, T, T) attention matrix for backward (see CausalSelfAttention).
    Linear layers have no bias, as in Llama and nanoGPT's bias=False ("a bit better and faster").
    """

    def __init__(
        self,
        vocab_size: int = 256,
        *,
        max_seq_len: int = 256,
        width: int = 128,
        depth: int = 4,
        heads: int = 4,
        positions: str = "learned",
        mlp_ratio: float = 4,
        dropout: float = 0.0,
        attention: str = "sdpa",
    ):
        sizes = {"vocab_size": vocab_size, "max_seq_len": max_seq_len, "width": width, "depth": depth, "heads": heads}
        for name, value in sizes.items():
            check_int(name, value)
        if width % heads:
            raise ValueError(f"width ({width}) must be divisible by heads ({heads}): each head gets width / heads.")
        if positions not in POSITIONS:
            raise ValueError(f"positions must be one of {', '.join(map(repr, POSITIONS))}, got {positions!r}.")
        head_dim = width // heads
        if positions == "rotary" and head_dim % 2:
            raise ValueError(
                f"rotary positions turn pairs of features, so width / heads must be even, got {width} / {heads} = "
                f"{head_dim}; choose another width or number of heads."
            )
        if not mlp_ratio > 0 or int(mlp_ratio * width) < 1:
            raise ValueError(f"mlp_ratio must be positive (the MLP is mlp_ratio × width wide), got {mlp_ratio!r}.")
        if not 0 <= dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}.")
        super().__init__()
        self.vocab_size, self.max_seq_len, self.width, self.depth = vocab_size, max_seq_len, width, depth
        self.heads, self.positions, self.attention = heads, positions, attention
        self.token_embedding = nn.Embedding(vocab_size, width)
        self.position_embedding = nn.Embedding(max_seq_len, width) if positions == "learned" else None
        if positions == "rotary":  # not persistent: recomputed here, never stored in a checkpoint
            cos, sin = rotary_tables(max_seq_len, head_dim)
            self.register_buffer("rotary_cos", cos, persistent=False)
            self.register_buffer("rotary_sin", sin, persistent=False)
        self.embedding_dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(width, heads, mlp_ratio, dropout, attention) for _ in range(depth))
        self.final_norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.head.weight = self.token_embedding.weight  # tied: one parameter, counted once by parameters()
        self._init_weights()

    def _init_weights(self) -> None:
        # Small normal weights (std 0.02, as GPT-2) give near-uniform first predictions: the
        # loss starts near ln(vocab_size). Each block adds two branches to the residual stream,
        # so with unit-scale branches its variance would grow with 2·depth; the layers that write
        # into the stream (attention's out, the MLP's second linear) start 1/sqrt(2·depth)
        # smaller, which keeps the stream's scale about the same at any depth.
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
        for block in self.blocks:
            for layer in (block.attention.out, block.mlp[2]):
                nn.init.normal_(layer.weight, mean=0.0, std=0.02 / math.sqrt(2 * self.depth))

    def _check_tokens(self, tokens) -> torch.Tensor:
        if not isinstance(tokens, torch.Tensor):
            raise TypeError(f"tokens must be a tensor of token ids, got {type(tokens).__name__}.")
        if tokens.dtype == torch.bool or tokens.is_floating_point() or tokens.is_complex():
            raise TypeError(f"tokens must be integer token ids (torch.long), got {tokens.dtype}; convert them first.")
        if tokens.dim() != 2 or tokens.shape[1] == 0:
            raise ValueError(
                f"tokens must have shape (batch, sequence) with at least one position, got {tuple(tokens.shape)}; "
                "add a batch dimension to one sequence with tokens[None]."
            )
        return tokens.long()  # nn.Embedding takes int64 (bytes may arrive as uint8)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T), T ≤ max_seq_len → logits (B, T, vocab_size) for the token after each position."""
        tokens = self._check_tokens(tokens)
        length = tokens.shape[1]
        if length > self.max_seq_len:
            raise ValueError(
                f"sequence length {length} is above the model's maximum {self.max_seq_len} (max_seq_len); "
                "build gk.models.gpt(max_seq_len=…) or use shorter windows."
            )
        x = self.token_embedding(tokens)  # (B, T, width)
        if self.position_embedding is not None:
            x = x + self.position_embedding(torch.arange(length, device=tokens.device))  # (T, width) broadcasts
        rotary = (self.rotary_cos[:length], self.rotary_sin[:length]) if self.positions == "rotary" else None
        x = self.embedding_dropout(x)
        for block in self.blocks:
            x = block(x, rotary)
        return self.head(self.final_norm(x))

    def generate(
        self,
        tokens: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Continue each row of `tokens` (B, T) by sampling; returns (B, T + max_new_tokens).

        Each step runs the model on the last max_seq_len tokens (no key-value cache: simple,
        and fast enough for a small model) and samples from softmax(logits / temperature),
        restricted to the top_k likeliest tokens if given. temperature=0 takes the likeliest
        token (greedy). Pass a torch.Generator on the tokens' device for repeatable samples.
        Runs in eval mode (no dropout) without gradients, and restores the training mode.
        """
        tokens = self._check_tokens(tokens)
        check_int("max_new_tokens", max_new_tokens, minimum=0)
        if not (isinstance(temperature, (int, float)) and 0 <= temperature < math.inf):
            raise ValueError(f"temperature must be a finite number ≥ 0 (0 means greedy), got {temperature!r}.")
        if top_k is not None:
            check_int("top_k", top_k, note="(or None)")
        if generator is not None:
            if not isinstance(generator, torch.Generator):
                raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}.")
            if generator.device.type != tokens.device.type:
                raise ValueError(
                    f"the generator is on {generator.device.type} but the tokens are on {tokens.device.type}; "
                    f"create it with torch.Generator(device={tokens.device.type!r})."
                )
        was_training = self.training
        self.eval()
        try:
            with torch.no_grad():
                for _ in range(max_new_tokens):
                    logits = self(tokens[:, -self.max_seq_len :])[:, -1, :].float()  # (B, vocab_size)
                    if temperature == 0:
                        next_tokens = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
                    else:
                        logits = logits / temperature
                        if top_k is not None and top_k < self.vocab_size:
                            kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
                            logits = logits.masked_fill(logits < kth, -math.inf)
                        next_tokens = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)  # (B, 1)
                    tokens = torch.cat((tokens, next_tokens), dim=1)
        finally:
            self.train(was_training)
        return tokens


def gpt(vocab_size: int = 256, **sizes) -> GPT:
    """The kit's small GPT, GPT(vocab_size, **sizes) (max_seq_len, width, depth, heads, positions,
    mlp_ratio, dropout, attention): about 0.85 M parameters at the defaults (bytes as tokens, 256 of them).

    Parameters: vocab_size·width (embedding and head, tied) + max_seq_len·width (learned
    positions only) + depth·(4 + 2·mlp_ratio)·width² (attention and MLP) + LayerNorms.
    """
    return GPT(vocab_size, **sizes)
