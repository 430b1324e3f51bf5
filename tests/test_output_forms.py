"""Every output form (issue 18 §1): models nobody here wrote, as a new user brings them.

- outputs as the model returns them: a segmentation dict {"out", "aux"} (torchvision's form, and a real
  torchvision model), a VAE's tuple (recon, mu, logvar), a Hugging Face-style classifier's {"loss", "logits"};
  your loss_fn and metrics get them whole, and accuracy appears only where it means something;
- a model's extra losses are never dropped silently (issue 24 §3): (logits, aux_loss) without a loss_fn
  warns once per fit, naming the loss_fn that adds them;
- gk.bench.flops_per_step on a Hugging Face-style batch with an attention mask that the model checks, and on
  a model that reads its own outputs (counted on a real step, saying so);
- gk.memory.estimate of recurrent models (LSTM, GRU) against the CPU measurement;
- activation checkpointing of an nn.Sequential without blocks (an MLP).
"""

import copy
import math
import warnings

import pytest
import torch
import torchvision
from torch import nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import gpukit as gk
from gpukit.memory.fused_workspaces import onednn_lstm_workspace_bytes
from gpukit.step import unpack_outputs

pytestmark = pytest.mark.usefixtures("one_thread")  # bytes and exact equality, not seconds (conftest.py)


# ---------------------------------------------------------------------------------------------
# Models in the forms users bring


class TinySegmenter(nn.Module):
    """torchvision's segmentation output form: {"out": (B, C, H, W), "aux": (B, C, H, W)}."""

    def __init__(self, classes: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.out, self.aux = nn.Conv2d(8, classes, 1), nn.Conv2d(8, classes, 1)

    def forward(self, images):
        features = self.body(images)
        return {"out": self.out(features), "aux": self.aux(features)}


class TinyVAE(nn.Module):
    """A variational autoencoder: (recon, mu, logvar)."""

    def __init__(self, features: int = 12, latent: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.encoder, self.decoder = nn.Linear(features, 2 * latent), nn.Linear(latent, features)

    def forward(self, x):
        mu, logvar = self.encoder(x).chunk(2, -1)
        z = mu + torch.randn_like(mu) * (0.5 * logvar).exp() if self.training else mu
        return self.decoder(z), mu, logvar


class TinyEncoder(nn.Module):
    """A BERT-style classifier, Hugging Face style: model(input_ids, attention_mask, labels) → {"loss", "logits"}.

    It builds its attention mask as Hugging Face does, with a check that reads values: whether the mask is
    all ones (then no mask at all)."""

    def __init__(self, attention: str = "sdpa", vocab: int = 50, width: int = 32, heads: int = 2, classes: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.attention, self.heads = attention, heads
        self.embed, self.position = nn.Embedding(vocab, width), nn.Embedding(16, width)
        self.register_buffer("position_ids", torch.arange(16)[None], persistent=False)
        self.qkv, self.proj, self.head = nn.Linear(width, 3 * width), nn.Linear(width, width), nn.Linear(width, classes)

    def forward(self, input_ids, attention_mask=None, labels=None):
        batch, length = input_ids.shape
        x = self.embed(input_ids) + self.position(self.position_ids[:, :length])
        bias = None
        if attention_mask is not None and not torch.all(attention_mask == 1):
            bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        else:
            scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
            y = (scores if bias is None else scores + bias).softmax(-1) @ v
        logits = self.head(self.proj(y.transpose(1, 2).reshape(batch, length, -1))[:, 0])
        return {"loss": F.cross_entropy(logits, labels) if labels is not None else None, "logits": logits}


def segmentation_loss(outputs, masks):
    return F.cross_entropy(outputs["out"], masks) + 0.5 * F.cross_entropy(outputs["aux"], masks)


def segmentation_data(count=16, size=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(count, 3, size, size, generator=generator)
    return images, (images[:, 0] > 0).long() + (images[:, 1] > 1).long()  # (B, H, W) classes 0..2


def pixel_accuracy(model, images, masks):
    with torch.no_grad():
        return (model.eval()(images)["out"].argmax(1) == masks).float().mean().item()


def vae_loss(outputs, target):
    recon, mu, logvar = outputs  # with a tensor here, batch size 3 would silently unpack recon's rows
    return F.mse_loss(recon, target) - 0.5 * (1 + logvar - mu**2 - logvar.exp()).sum(-1).mean()


def text_batch(padded=True, seed=0):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, 50, (4, 16), generator=generator)
    attention_mask = torch.ones(4, 16, dtype=torch.long)
    if padded:
        input_ids[1, 10:], attention_mask[1, 10:] = 0, 0
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": torch.tensor([0, 1, 2, 1])}


# ---------------------------------------------------------------------------------------------
# The prediction, found in one place


def test_the_prediction_is_found_in_every_form_and_only_there():
    logits, out, first, loss = torch.randn(2, 3), torch.randn(2, 3, 4, 4), torch.randn(2, 5), torch.tensor(1.0)

    class Output:  # a ModelOutput-like object with attributes
        def __init__(self, **fields):
            self.__dict__.update(fields)

    cases = [
        (first, first, None),
        ((first, torch.randn(2, 2)), first, None),
        ([None, first], first, None),  # the first tensor of a tuple or list
        ({"logits": logits, "loss": loss}, logits, loss),
        ({"out": out, "aux": torch.randn(2, 3, 4, 4)}, out, None),
        ({"logits": logits, "out": out}, logits, None),
        (Output(logits=logits, loss=loss), logits, loss),
        ({"mean": first}, None, None),
        ("not a tensor", None, None),
    ]
    for outputs, prediction, model_loss in cases:
        found, found_loss = unpack_outputs(outputs)
        assert found is prediction and found_loss is model_loss, outputs


# ---------------------------------------------------------------------------------------------
# Your loss_fn and metrics get the outputs as the model returned them


def test_a_segmentation_dict_trains_with_your_loss_and_reports_pixel_accuracy(device):
    images, masks = segmentation_data()
    seen = []

    def loss_fn(outputs, target):
        seen.append((type(outputs), tuple(sorted(outputs))))
        return segmentation_loss(outputs, target)

    metrics = {"aux_share": lambda outputs, target: outputs["aux"].abs().mean() / outputs["out"].abs().mean()}
    model = TinySegmenter()
    history = gk.fit(
        model, [(images[:8], masks[:8]), (images[8:], masks[8:])], epochs=3, lr=0.05, loss_fn=loss_fn,
        metrics=metrics, progress=False, device=device,
    )  # fmt: skip
    assert set(seen) == {(dict, ("aux", "out"))} and "train_aux_share" in history.epochs[-1]
    assert history.epochs[-1]["train_loss"] < history.epochs[0]["train_loss"]
    result = gk.evaluate(model, [(images, masks)], loss_fn=segmentation_loss, metrics=metrics, device=device)
    assert result["accuracy"] == pytest.approx(pixel_accuracy(model, images, masks), abs=1e-6)  # from "out"
    with torch.no_grad():
        assert result["loss"] == pytest.approx(segmentation_loss(model(images), masks).item(), rel=1e-5)


def test_a_segmentation_dict_without_a_loss_fn_uses_out_for_cross_entropy(device):
    images, masks = segmentation_data()
    model = TinySegmenter().eval()
    result = gk.evaluate(model, [(images, masks)], device=device)
    with torch.no_grad():
        assert result["loss"] == pytest.approx(F.cross_entropy(model(images)["out"], masks).item(), rel=1e-5)
    assert result["accuracy"] == pytest.approx(pixel_accuracy(model, images, masks), abs=1e-6)


def test_a_torchvision_segmentation_model_with_its_aux_head_trains(device):
    images, masks = segmentation_data(count=4, size=32)
    torch.manual_seed(0)
    model = torchvision.models.segmentation.deeplabv3_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=3, aux_loss=True
    )
    history = gk.fit(model, [(images, masks)], loss_fn=segmentation_loss, progress=False, device=device)
    assert math.isfinite(history.epochs[-1]["train_loss"]) and 0 <= history.epochs[-1]["train_accuracy"] <= 1


def test_a_vae_loss_gets_the_whole_tuple_at_batch_size_3(device):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(12, 12, generator=generator)
    shapes = []

    def loss_fn(outputs, target):
        shapes.append([tuple(part.shape) for part in outputs])
        return vae_loss(outputs, target)

    model = TinyVAE()
    history = gk.fit(
        model, [(x[i : i + 3], x[i : i + 3]) for i in range(0, 12, 3)], epochs=2, lr=0.01, optimizer="adamw",
        loss_fn=loss_fn, metrics={"recon": lambda outputs, target: F.l1_loss(outputs[0], target)},
        progress=False, device=device,
    )  # fmt: skip
    assert shapes[0] == [(3, 12), (3, 2), (3, 2)] and len(shapes) == 8
    assert not any("accuracy" in column for column in history.epochs[-1])  # a float target: no accuracy
    result = gk.evaluate(model, [(x, x)], loss_fn=vae_loss, device=device)
    with torch.no_grad():
        assert result["loss"] == pytest.approx(vae_loss(model.eval()(x), x).item(), rel=1e-5)


def test_a_loss_fn_written_for_a_tensor_still_gets_the_tensor(device):
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 4, generator=generator), torch.randint(3, (16,), generator=generator)
    kinds = set()

    def loss_fn(logits, target):
        kinds.add(type(logits))
        return F.cross_entropy(logits, target)

    torch.manual_seed(0)
    history = gk.fit(nn.Linear(4, 3), [(x, y)], loss_fn=loss_fn, progress=False, device=device)
    assert kinds == {torch.Tensor} and "train_accuracy" in history.epochs[-1]  # (B, C) against classes


@pytest.mark.parametrize("loss_fn", [None, nn.CrossEntropyLoss(), F.cross_entropy])
def test_pytorch_losses_get_the_prediction_of_a_tuple(loss_fn, device):
    """PyTorch's losses take a tensor: they get the prediction (the first tensor), as before."""
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 4, generator=generator), torch.randint(3, (16,), generator=generator)
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    model.forward = lambda inputs, forward=model.forward: (forward(inputs), inputs.mean())
    result = gk.evaluate(model, [(x, y)], loss_fn=loss_fn, device=device)
    with torch.no_grad():
        assert result["loss"] == pytest.approx(F.cross_entropy(model(x)[0], y).item(), rel=1e-6)
    assert "accuracy" in result


def test_accuracy_only_where_it_means_something(device):
    """A classifier's own loss over (B, C) scores classes: accuracy. An LM's own loss over (B, T) may shift its
    labels, integer targets that are not classes of the prediction, or a prediction of another shape: none."""
    batch = text_batch()
    model = TinyEncoder()
    result = gk.evaluate(model, [batch], device=device)
    with torch.no_grad():
        logits = model(batch["input_ids"], batch["attention_mask"])["logits"]
    assert result["accuracy"] == pytest.approx((logits.argmax(-1) == batch["labels"]).float().mean().item())
    counts = torch.tensor([0, 5, 9, 2])  # integer targets, but not classes of a (B, 3) prediction
    poisson = gk.evaluate(
        nn.Linear(4, 3), [(torch.randn(4, 4), counts)], loss_fn=lambda outputs, target: outputs.mean(), device=device
    )
    assert "accuracy" not in poisson
    one_output = gk.evaluate(nn.Linear(4, 1), [(torch.randn(4, 4), torch.zeros(4, dtype=torch.long))], device=device)
    assert "accuracy" not in one_output  # one "class" cannot be wrong
    x = torch.randn(6, 12)
    labelled = gk.evaluate(TinyVAE(), [(x, torch.arange(6) % 2)], loss_fn=lambda o, t: vae_loss(o, x), device=device)
    assert "accuracy" not in labelled  # recon (B, 12) has the shape of class scores for (B,) labels, but is none


class MixtureOfExperts(nn.Module):
    """Two experts and a router, returning (logits, aux_loss): the load-balancing loss of a mixture of experts,
    which the model leaves for the training loss to add (as Switch Transformer and Mixtral's code do)."""

    def __init__(self, features: int = 6, classes: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.router, self.experts = nn.Linear(features, 2), nn.ModuleList(nn.Linear(features, classes) for _ in "ab")

    def forward(self, x):
        weights = self.router(x).softmax(-1)  # (B, 2)
        logits = sum(weights[:, i : i + 1] * expert(x) for i, expert in enumerate(self.experts))
        aux_loss = 2 * (weights.mean(0) ** 2).sum()  # 1 when the experts share the load evenly
        return logits, aux_loss


def moe_data(batches: int = 3) -> list:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator))] * batches


def ignored_warnings(caught) -> list:
    return [w for w in caught if "leaves out" in str(w.message)]


def test_a_tuple_with_an_aux_loss_and_no_loss_fn_warns_once_per_fit_naming_the_fix(device):
    options = dict(max_steps=3, log_every=1, progress=False, device=device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warning recorded: "once" is the kit's doing, not the filter's
        history = gk.fit(MixtureOfExperts(), moe_data(), **options)
    (warned,) = ignored_warnings(caught)
    message = str(warned.message)
    assert "the model returns a tuple of 2 tensors of shapes (8, 3), (): outputs[1] is a scalar tensor" in message
    assert "loss_fn=lambda outputs, target: F.cross_entropy(outputs[0], target) + outputs[1]" in message
    assert warned.filename == __file__  # it points at the fit call
    model = MixtureOfExperts()
    inputs, target = moe_data()[0]
    assert history.steps[0]["loss"] == pytest.approx(F.cross_entropy(model(inputs)[0], target).item())  # CE alone
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        gk.fit(MixtureOfExperts(), moe_data(), **options)
    assert len(ignored_warnings(again)) == 1  # once per fit: the next fit says it again


def test_a_loss_fn_that_adds_the_aux_loss_trains_on_it_without_a_warning(device):
    def with_balance(outputs, target):
        logits, aux_loss = outputs
        return F.cross_entropy(logits, target) + 0.1 * aux_loss

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = gk.fit(
            MixtureOfExperts(),
            moe_data(),
            loss_fn=with_balance,
            max_steps=1,
            log_every=1,
            progress=False,
            device=device,
        )
    assert ignored_warnings(caught) == []
    inputs, target = moe_data()[0]
    expected = with_balance(MixtureOfExperts()(inputs), target).item()
    assert (
        history.steps[0]["loss"]
        == pytest.approx(expected)
        != pytest.approx(F.cross_entropy(MixtureOfExperts()(inputs)[0], target).item())
    )


def test_memory_accepts_a_dict_without_logits_and_a_tuple_with_your_loss_fn():
    images, masks = segmentation_data(count=8)
    for model, batch, loss_fn in [
        (TinySegmenter(), (images, masks), segmentation_loss),
        (TinyVAE(), (torch.randn(3, 12), torch.randn(3, 12)), vae_loss),
    ]:
        measured = gk.memory.breakdown(model, batch, device="cpu", loss_fn=loss_fn)
        predicted = gk.memory.estimate(model, batch, device="cpu", loss_fn=loss_fn)
        assert predicted.total == pytest.approx(measured.total, rel=0.1)
        plan = gk.memory.max_batch_size(model, batch, budget=2**22, device="cpu", loss_fn=loss_fn)
        assert plan.batch_size >= 1 and plan.predicted_peak <= 2**22


# ---------------------------------------------------------------------------------------------
# FLOPs of a Hugging Face-style batch with an attention mask


def counted_for_real(model, batch):
    """FlopCounterMode around a real step of a copy of the model. SDPA runs its math kernel: torch's counter
    has no formula for the CPU's flash kernel (it would count its attention as 0), while the meta run counts
    the math kernel's matmuls, as on a GPU it counts the flash kernel's."""
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH):
        gk.step.forward_backward(copy.deepcopy(model), batch)
    return counter.get_total_flops()


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("padded", [True, False])
def test_flops_of_a_batch_whose_mask_the_model_checks_match_a_real_count(attention, padded):
    model, batch = TinyEncoder(attention), text_batch(padded)
    before = copy.deepcopy(batch)
    assert gk.bench.flops_per_step(model, batch) == counted_for_real(model, batch) > 0
    assert all(torch.equal(batch[key], before[key]) for key in batch)  # the batch is left as it was
    assert all(parameter.device.type == "cpu" and parameter.grad is None for parameter in model.parameters())


def test_flops_of_a_segmentation_dict_with_your_loss_fn():
    images, masks = segmentation_data(count=4)
    segmenter = TinySegmenter()
    counter = FlopCounterMode(display=False)
    with counter:
        gk.step.forward_backward(copy.deepcopy(segmenter), (images, masks), gk.step.Loss(segmentation_loss))
    assert gk.bench.flops_per_step(segmenter, (images, masks), loss_fn=segmentation_loss) == counter.get_total_flops()


def test_flops_of_a_model_that_reads_its_own_outputs_are_counted_on_a_real_step_saying_so():
    class Branching(nn.Linear):
        def forward(self, x):
            y = super().forward(x)
            return y if y.max() > 0 else -y  # a branch on values computed from the weights

    model, batch = Branching(4, 3), (torch.randn(2, 4), torch.tensor([0, 1]))
    with pytest.warns(UserWarning, match="reads a number .* computed from its weights.*counted on a real forward"):
        flops = gk.bench.flops_per_step(model, batch)
    assert flops == counted_for_real(model, batch) > 0
    assert model.weight.grad is None  # a copy ran


# ---------------------------------------------------------------------------------------------
# Memory of recurrent models


class Recurrent(nn.Module):
    """A sequence classifier: embedding, an LSTM or GRU, the last step's state to the classes."""

    def __init__(self, kind=nn.LSTM, hidden=32, layers=1, bidirectional=False, vocab=100, classes=5):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, hidden)
        self.rnn = kind(hidden, hidden, num_layers=layers, bidirectional=bidirectional, batch_first=True)
        self.head = nn.Linear(hidden * (2 if bidirectional else 1), classes)

    def forward(self, tokens):
        states, _ = self.rnn(self.embed(tokens))
        return self.head(states[:, -1])


@pytest.mark.parametrize(
    "kind, hidden, steps, layers, bidirectional",
    [
        (nn.LSTM, 32, 12, 1, False),
        (nn.LSTM, 128, 64, 1, False),
        (nn.LSTM, 48, 20, 2, True),
        (nn.GRU, 64, 24, 2, False),
    ],
)
def test_the_estimate_of_a_recurrent_model_is_within_10_percent_of_the_cpu_measurement(
    kind, hidden, steps, layers, bidirectional
):
    model = Recurrent(kind, hidden, layers, bidirectional)
    generator = torch.Generator().manual_seed(0)
    batch = (torch.randint(100, (16, steps), generator=generator), torch.randint(5, (16,), generator=generator))
    measured = gk.memory.breakdown(model, batch, device="cpu")
    predicted = gk.memory.estimate(model, batch, device="cpu")
    assert predicted.total == pytest.approx(measured.total, rel=0.1)
    assert predicted.activations == pytest.approx(measured.activations, rel=0.1)


def test_the_lstm_workspace_size_is_the_one_the_cpu_kernel_returns():
    sizes = []

    class Workspaces(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.mkldnn_rnn_layer.default:
                sizes.append(out[3].numel())
            return out

    shapes = [(1, 1, 8, 8), (3, 12, 40, 32), (16, 64, 128, 128), (7, 5, 300, 100), (64, 9, 8, 256)]
    for batch, steps, features, hidden in shapes:
        with Workspaces():
            nn.LSTM(features, hidden)(torch.randn(steps, batch, features))
    if not sizes:
        pytest.skip("this build of PyTorch runs the LSTM without oneDNN on this CPU")
    assert sizes == [
        onednn_lstm_workspace_bytes(steps, batch, features, hidden) for batch, steps, features, hidden in shapes
    ]


# ---------------------------------------------------------------------------------------------
# Activation checkpointing of a model without blocks


def deep_mlp(width=256, depth=8, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        *[layer for _ in range(depth) for layer in (nn.Linear(width, width), nn.ReLU())], nn.Linear(width, 10)
    )


class MLP(nn.Module):
    """An MLP class of its own whose layers are an nn.Sequential (with Dropout: recomputed the same)."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.Sequential(
            *[layer for _ in range(6) for layer in (nn.Linear(64, 64), nn.GELU(), nn.Dropout(0.1))], nn.Linear(64, 4)
        )

    def forward(self, x):
        return self.layers(x.flatten(1))


def gradients(model, x, y, seed=0):
    torch.manual_seed(seed)
    F.cross_entropy(model(x), y).backward()
    return [parameter.grad for parameter in model.parameters()]


@pytest.mark.parametrize("build, layers", [(deep_mlp, 17), (MLP, 19)])
def test_an_mlp_is_split_into_segments_as_checkpoint_sequential_does(build, layers):
    plain = build()
    checked = copy.deepcopy(plain)
    plan = gk.memory.apply_activation_checkpointing(checked)
    segments = round(math.sqrt(layers))
    assert len(plan.regions) == segments - 1 and len(plan.blocks) == layers  # the last segment runs as it is
    assert f"({layers} layers found)" in str(plan) and "checkpoint_sequential" in str(plan)
    x, y = torch.randn(32, 256 if build is deep_mlp else 64), torch.arange(32) % 4
    for a, b in zip(gradients(plain, x, y), gradients(checked, x, y)):
        torch.testing.assert_close(a, b)
    gk.memory.remove_activation_checkpointing(checked)
    assert not gk.memory.has_activation_checkpointing(checked)


def test_checkpointing_an_mlp_says_whether_the_measured_peak_dropped():
    x, y = torch.randn(512, 256), torch.arange(512) % 10
    model = deep_mlp()
    plan = gk.memory.apply_activation_checkpointing(model, batch=(x, y))
    assert plan.peak_after < plan.peak_before and "measured peak of a training step" in str(plan)
    unchecked = deep_mlp()
    assert gk.memory.breakdown(unchecked, (x, y), device="cpu").total == plan.peak_before  # measured independently
    small = deep_mlp()
    with pytest.warns(UserWarning, match="did not lower the measured peak"):
        plan = gk.memory.apply_activation_checkpointing(small, batch=(x[:2], y[:2]))  # weights dominate
    assert plan.peak_after >= plan.peak_before and "did not lower" in str(plan)


def test_a_model_without_blocks_or_a_sequential_still_says_what_to_do():
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x):
            return self.second(self.first(x).relu())

    with pytest.raises(ValueError, match="found no blocks.*no nn.Sequential of layers.*modules=\\[...\\]"):
        gk.memory.apply_activation_checkpointing(Plain())
    with pytest.raises(ValueError, match="in one segment leave nothing to checkpoint"):
        gk.memory.apply_activation_checkpointing(deep_mlp(), segments=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no batch: nothing measured, nothing warned
        gk.memory.apply_activation_checkpointing(deep_mlp(), every=4)
