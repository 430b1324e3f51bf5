import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import gpukit as gk


@pytest.mark.parametrize("make", [lambda: gk.models.fast_cnn(8), gk.models.resnet18])
def test_output_shape_and_channels_last(make):
    torch.manual_seed(0)
    model = make().eval()
    images = torch.randn(2, 3, 32, 32)
    logits = model(images)
    assert logits.shape == (2, 10)
    model = model.to(memory_format=torch.channels_last)
    torch.testing.assert_close(
        model(images.contiguous(memory_format=torch.channels_last)), logits, atol=1e-4, rtol=1e-4
    )


def test_width_scales_parameters():
    small, large = (gk.models.count_parameters(gk.models.fast_cnn(w)) for w in (8, 16))
    assert 3.5 < large / small < 4.1  # convolution weights grow with width²


def test_resnet18_keeps_32x32_resolution_in_the_stem():
    model = gk.models.resnet18()
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert isinstance(model.maxpool, torch.nn.Identity)


def test_bad_width():
    with pytest.raises(ValueError, match="width"):
        gk.models.fast_cnn(0)


# The small GPT ----------------------------------------------------------------------------------------------------

POSITIONS = ["learned", "rotary"]


def tiny_gpt(positions="learned", **kwargs):
    options = dict(max_seq_len=16, width=32, depth=2, heads=2, positions=positions)
    return gk.models.gpt(64, **{**options, **kwargs})


def random_tokens(batch_size, length, vocab_size=64, seed=0):
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, vocab_size, (batch_size, length), device="cpu", generator=generator)


def next_token_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@pytest.mark.parametrize("positions", POSITIONS)
def test_gpt_output_shape(positions):
    torch.manual_seed(0)
    model = tiny_gpt(positions).eval()
    assert (model.vocab_size, model.max_seq_len, model.width, model.depth, model.heads, model.positions) == (
        64,
        16,
        32,
        2,
        2,
        positions,
    )
    for length in (1, 7, 16):
        logits = model(random_tokens(3, length))
        assert type(logits) is torch.Tensor and logits.shape == (3, length, 64) and logits.dtype == torch.float32
    tokens = random_tokens(2, 8)
    torch.testing.assert_close(model(tokens.to(torch.uint8)), model(tokens))  # bytes may come as uint8


@pytest.mark.parametrize("positions", POSITIONS)
def test_gpt_is_causal(positions):
    torch.manual_seed(0)
    model = tiny_gpt(positions).eval()
    tokens = random_tokens(2, 16)
    changed = tokens.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 64
    before, after = model(tokens), model(changed)
    torch.testing.assert_close(after[:, :9], before[:, :9])  # the past cannot see the future
    assert not torch.allclose(after[:, 9:], before[:, 9:])  # from position 9 on, the change is seen


@pytest.mark.parametrize("positions", POSITIONS)
def test_gpt_head_is_tied_to_the_token_embedding(positions):
    model = gk.models.gpt(100, max_seq_len=24, width=48, depth=3, heads=4, positions=positions, mlp_ratio=2)
    assert model.head.weight is model.token_embedding.weight
    assert sum(p is model.token_embedding.weight for p in model.parameters()) == 1
    width, hidden = 48, 2 * 48
    per_block = 4 * width * width + 2 * width * hidden + 2 * 2 * width  # qkv, out, MLP, two LayerNorms
    expected = 100 * width + 3 * per_block + 2 * width + (24 * width if positions == "learned" else 0)
    assert gk.models.count_parameters(model) == expected
    assert not any("rotary" in name for name in model.state_dict())  # the rotary tables are not persistent


def test_gpt_rejects_bad_inputs():
    model = tiny_gpt()
    with pytest.raises(ValueError, match=r"sequence length 17 is above the model's maximum 16 \(max_seq_len\)"):
        model(random_tokens(1, 17))
    with pytest.raises(TypeError, match="integer token ids"):
        model(torch.rand(1, 4, device="cpu"))
    with pytest.raises(TypeError, match="tensor"):
        model([[1, 2, 3]])
    for shape in [(4,), (1, 2, 4), (1, 0)]:
        with pytest.raises(ValueError, match=r"\(batch, sequence\)"):
            model(torch.zeros(shape, dtype=torch.long, device="cpu"))


def test_gpt_rejects_bad_settings():
    with pytest.raises(ValueError, match="divisible by heads"):
        gk.models.gpt(width=30, heads=4)
    with pytest.raises(ValueError, match="'learned', 'rotary'"):
        gk.models.gpt(positions="sinusoidal")
    with pytest.raises(ValueError, match="even"):
        gk.models.gpt(width=12, heads=4, positions="rotary")  # head dimension 3
    with pytest.raises(ValueError, match=r"attention must be one of 'sdpa', 'manual', got 'flash'"):
        gk.models.gpt(attention="flash")
    for setting in [dict(depth=0), dict(vocab_size=0), dict(max_seq_len=-1), dict(dropout=1.0), dict(mlp_ratio=0)]:
        with pytest.raises(ValueError):
            gk.models.gpt(**setting)


@pytest.mark.parametrize("positions", POSITIONS)
def test_gpt_manual_attention_gives_the_fused_attentions_logits_and_gradients(positions):
    torch.manual_seed(0)
    fused = tiny_gpt(positions)
    manual = tiny_gpt(positions, attention="manual")
    manual.load_state_dict(fused.state_dict())  # the same weights: only the attention's code differs
    assert {block.attention.attention for block in manual.blocks} == {"manual"} and manual.attention == "manual"
    tokens, targets = random_tokens(3, 16, seed=1), random_tokens(3, 16, seed=2)
    fused_logits, manual_logits = fused(tokens), manual(tokens)
    torch.testing.assert_close(manual_logits, fused_logits, rtol=1e-5, atol=1e-5)  # fp32 rounding only
    next_token_loss(fused_logits, targets).backward()
    next_token_loss(manual_logits, targets).backward()
    for (name, parameter), other in zip(fused.named_parameters(), manual.parameters()):
        torch.testing.assert_close(other.grad, parameter.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_manual_attention_is_causal_and_matches_sdpa_with_dropout_off():
    generator = torch.Generator(device="cpu").manual_seed(0)
    queries, keys, values = torch.randn(3, 2, 4, 5, 8, device="cpu", generator=generator)  # (B, heads, T, head_dim)
    expected = F.scaled_dot_product_attention(queries, keys, values, is_causal=True)
    torch.testing.assert_close(gk.models.manual_attention(queries, keys, values), expected, rtol=1e-5, atol=1e-6)
    changed = keys.clone()
    changed[:, :, 3] += 1  # a later key: positions 0…2 must not see it
    torch.testing.assert_close(
        gk.models.manual_attention(queries, changed, values)[:, :, :3], expected[:, :, :3], rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("positions", POSITIONS)
def test_gpt_generate(positions):
    torch.manual_seed(0)
    model = tiny_gpt(positions)
    prompt = random_tokens(2, 5)
    sampled = model.generate(prompt, 6, generator=torch.Generator(device="cpu").manual_seed(1))
    assert sampled.shape == (2, 11) and sampled.dtype == torch.long
    assert torch.equal(sampled[:, :5], prompt)
    again = model.generate(prompt, 6, generator=torch.Generator(device="cpu").manual_seed(1))
    assert torch.equal(sampled, again)  # the same generator seed gives the same samples
    assert model.training  # the training mode is restored

    greedy = model.eval().generate(prompt, 6, temperature=0)
    assert not model.training
    # Each greedy token is the argmax of the logits at the position before it (causality lets one pass check all).
    assert torch.equal(model(greedy[:, :-1]).argmax(dim=-1)[:, 4:], greedy[:, 5:])
    assert torch.equal(model.generate(prompt, 6, top_k=1), greedy)  # top-1 sampling is greedy too

    long_prompt = random_tokens(2, 20)  # longer than max_seq_len: the context is cropped to the last 16 tokens
    assert model.generate(long_prompt, 3, top_k=5).shape == (2, 23)
    assert torch.equal(model.generate(prompt, 0), prompt)


def test_gpt_generate_rejects_bad_arguments():
    model = tiny_gpt()
    prompt = random_tokens(1, 3)
    for arguments in [
        dict(max_new_tokens=-1),
        dict(max_new_tokens=2.5),
        dict(max_new_tokens=2, temperature=-1.0),
        dict(max_new_tokens=2, temperature=float("nan")),
        dict(max_new_tokens=2, top_k=0),
    ]:
        with pytest.raises(ValueError):
            model.generate(prompt, **arguments)
    with pytest.raises(TypeError, match="torch.Generator"):
        model.generate(prompt, 2, generator=0)
    with pytest.raises(ValueError, match=r"\(batch, sequence\)"):
        model.generate(prompt[0], 2)


@pytest.mark.parametrize("positions", POSITIONS)
def test_gpt_learns_a_repeated_string(positions):
    text = torch.tensor(list(b"the quick brown fox jumps over the lazy dog. " * 8), device="cpu")
    counts = torch.bincount(text, minlength=256).double()
    frequencies = counts[counts > 0] / counts.sum()
    unigram_entropy = -(frequencies * frequencies.log()).sum().item()  # nats: the best loss without context (≈ 3.05)

    torch.manual_seed(0)
    model = gk.models.gpt(256, max_seq_len=32, width=32, depth=2, heads=2, positions=positions)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    generator = torch.Generator(device="cpu").manual_seed(0)
    offsets = torch.arange(33, device="cpu")
    losses = []
    for _ in range(40):
        starts = torch.randint(0, len(text) - 33, (16, 1), device="cpu", generator=generator)
        windows = text[starts + offsets]  # (16, 33): inputs and their next tokens
        loss = next_token_loss(model(windows[:, :-1]), windows[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert abs(losses[0] - math.log(256)) < 0.2  # small initial weights: near-uniform first predictions
    assert losses[-1] < 0.6 * losses[0]
    assert losses[-1] < unigram_entropy - 0.5  # it uses the context, not just letter frequencies


@pytest.mark.parametrize("positions", POSITIONS)
def test_gpt_runs_under_bf16_autocast(positions):
    torch.manual_seed(0)
    model = tiny_gpt(positions)
    tokens = random_tokens(2, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens)
        loss = next_token_loss(logits[:, :-1].float(), tokens[:, 1:])
    loss.backward()
    assert logits.dtype == torch.bfloat16 and torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() and p.grad.dtype == torch.float32 for p in model.parameters())
    model.eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model.generate(tokens[:, :4], 3, temperature=0).shape == (2, 7)


@pytest.mark.parametrize("positions", POSITIONS)
def test_gpt_flops_are_6_n_per_token_plus_attention(positions):
    vocab_size, length, width, depth, batch_size = 256, 64, 64, 2, 2
    with torch.device("meta"):  # shapes only: nothing is computed
        model = gk.models.gpt(vocab_size, max_seq_len=length, width=width, depth=depth, heads=4, positions=positions)
        tokens = torch.zeros(batch_size, length, dtype=torch.long)
    with FlopCounterMode(display=False) as counter:
        next_token_loss(model(tokens), tokens).backward()
    matmul_parameters = depth * 12 * width**2 + vocab_size * width  # blocks and the tied head; not positions
    tokens_seen = batch_size * length
    # 2 FLOPs per parameter per token forward and 4 backward; attention scores and their use of the values
    # add 4·T·width per token and layer forward, 8 backward (counted over all T keys, not only the causal half).
    expected = 6 * matmul_parameters * tokens_seen + 12 * depth * length * width * tokens_seen
    ratio = counter.get_total_flops() / expected
    assert 0.9 < ratio < 1.1, f"measured {counter.get_total_flops():,} FLOPs, {ratio:.3f}× the estimate"


def saved_activation_bytes(model, tokens, targets):
    """Bytes autograd saves for backward in a forward pass and loss: each storage once, parameters and buffers left out."""
    excluded = {tensor.untyped_storage()._cdata for tensor in [*model.parameters(), *model.buffers()]}
    sizes = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage._cdata not in excluded:
            sizes[storage._cdata] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = next_token_loss(model(tokens), targets)
    return loss, sum(sizes.values())


@pytest.mark.parametrize("positions", POSITIONS)
def test_gpt_blocks_are_checkpointed(positions):
    torch.manual_seed(0)
    model = tiny_gpt(positions, depth=4)
    assert [name for name, *_ in gk.memory.find_blocks(model)] == [f"blocks.{i}" for i in range(4)]
    checkpointed = copy.deepcopy(model)
    plan = gk.memory.apply_activation_checkpointing(checkpointed)
    assert plan.regions == [[f"blocks.{i}"] for i in range(4)]

    tokens, targets = random_tokens(4, 16, seed=1), random_tokens(4, 16, seed=2)
    loss, saved = saved_activation_bytes(model, tokens, targets)
    checkpointed_loss, checkpointed_saved = saved_activation_bytes(checkpointed, tokens, targets)
    loss.backward()
    checkpointed_loss.backward()
    torch.testing.assert_close(checkpointed_loss, loss)
    for (name, parameter), other in zip(model.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(other.grad, parameter.grad, msg=name)
    block_input_bytes = 4 * 16 * 32 * 4  # (B, T, width) float32: what each checkpointed block keeps
    assert checkpointed_saved >= 4 * block_input_bytes  # the block inputs are still counted
    assert checkpointed_saved < saved / 2
