"""Any model, any batch, third wave: graph batches that move themselves (torch_geometric's), samples counted by the
target, dataclass outputs read like the other forms, a model call that fails on the training data explained, and
cross-entropy's shape error naming loss_fn."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gpukit as gk

CPU = torch.device("cpu")
FEATURES, CLASSES = 4, 3


class GraphClassifier(nn.Module):
    """One round of neighbour sums, then the mean over each graph's nodes: (graphs, CLASSES) logits."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.node, self.head = nn.Linear(FEATURES, 8), nn.Linear(8, CLASSES)
        with torch.no_grad():
            self.head.weight.mul_(10)  # confident logits: losses that differ from graph to graph

    def forward(self, x, edge_index, graph_index):
        hidden = self.node(x).relu()  # (nodes, 8)
        hidden = hidden.index_add(0, edge_index[1], hidden[edge_index[0]])  # each node plus its neighbours
        graphs = int(graph_index.max()) + 1
        sums = torch.zeros(graphs, hidden.shape[1]).index_add(0, graph_index, hidden)
        nodes = torch.zeros(graphs).index_add(0, graph_index, torch.ones(len(graph_index)))
        return self.head(sums / nodes[:, None])


class GraphBatchModel(GraphClassifier):
    """The same model called as PyG's are: model(batch)."""

    def forward(self, batch):
        return super().forward(batch.x, batch.edge_index, batch.batch)


@dataclass
class GraphBatch:
    """A hand-written batch of the shape of torch_geometric's DataBatch: it moves itself and carries its target."""

    x: torch.Tensor  # (nodes, FEATURES)
    edge_index: torch.Tensor  # (2, edges)
    batch: torch.Tensor  # (nodes,): the graph of each node
    y: torch.Tensor  # (graphs,): one class per graph
    num_graphs: int

    def to(self, device):
        moved = {name: getattr(self, name).to(device) for name in ("x", "edge_index", "batch", "y")}
        return GraphBatch(**moved, num_graphs=self.num_graphs)


def graph_batch(node_counts: list[int], seed: int) -> GraphBatch:
    """Graphs of the given node counts, each a chain (i → i + 1), with a random class each."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.tensor([0, *node_counts[:-1]]).cumsum(0)
    edges = [torch.stack([torch.arange(n - 1), torch.arange(1, n)]) + start for n, start in zip(node_counts, starts)]
    return GraphBatch(
        x=torch.randn(sum(node_counts), FEATURES, generator=generator),
        edge_index=torch.cat(edges, 1),
        batch=torch.repeat_interleave(torch.arange(len(node_counts)), torch.tensor(node_counts)),
        y=torch.randint(0, CLASSES, (len(node_counts),), generator=generator),
        num_graphs=len(node_counts),
    )


# Batches of unequal sizes, graphs of unequal node counts: a mean weighted by nodes differs from one by graphs.
GRAPH_BATCHES = [graph_batch([2, 9, 3], seed=0), graph_batch([12, 2, 2, 3, 10], seed=1)]


def per_graph_mean_loss(model: nn.Module, batches: list[GraphBatch]) -> tuple[float, float]:
    """(the mean cross-entropy over graphs, the mean weighted by nodes instead), computed by hand."""
    with torch.no_grad():
        losses = [F.cross_entropy(model(b.x, b.edge_index, b.batch), b.y, reduction="sum") for b in batches]
        means = [F.cross_entropy(model(b.x, b.edge_index, b.batch), b.y) for b in batches]
    graphs, nodes = sum(b.num_graphs for b in batches), sum(len(b.x) for b in batches)
    by_nodes = sum(mean * len(b.x) for mean, b in zip(means, batches)) / nodes
    return (sum(losses) / graphs).item(), by_nodes.item()


def test_a_graph_batch_object_is_passed_whole_and_its_y_is_the_target():
    """An object with .to(device) and .y (torch_geometric's DataBatch shape), without torch_geometric."""
    model = GraphBatchModel()
    by_graphs, by_nodes = per_graph_mean_loss(GraphClassifier(), GRAPH_BATCHES)
    assert abs(by_graphs - by_nodes) > 0.01  # the data tells the two weightings apart
    result = gk.evaluate(model, GRAPH_BATCHES, device=CPU)
    assert result["loss"] == pytest.approx(by_graphs, rel=1e-6)
    assert result["samples"] == 8  # graphs, not the 43 nodes
    history = gk.fit(model, GRAPH_BATCHES, max_steps=2, log_every=1, progress=False, device=CPU, lr=0.05)
    assert history.micro_batch_size == 3  # the first batch's graphs
    first = history.steps[0]
    assert first["loss"] == pytest.approx(
        F.cross_entropy(GraphClassifier()(*astuple(GRAPH_BATCHES[0])[:3]), GRAPH_BATCHES[0].y).item(), rel=1e-6
    )
    assert first["samples_per_second"] == pytest.approx(3 / first["step_time"], rel=1e-6)  # graphs, not nodes
    assert not torch.equal(model.head.weight, GraphClassifier().head.weight)


def astuple(batch: GraphBatch) -> tuple:
    return batch.x, batch.edge_index, batch.batch, batch.y


def test_evaluate_counts_samples_by_the_target_not_by_the_first_tensor():
    """((x, edge_index, graph_index), y) tuples: x holds nodes, y graphs; the mean loss is over graphs."""
    batches = [((b.x, b.edge_index, b.batch), b.y) for b in GRAPH_BATCHES]
    by_graphs, _ = per_graph_mean_loss(GraphClassifier(), GRAPH_BATCHES)
    result = gk.evaluate(GraphClassifier(), batches, device=CPU)
    assert result["loss"] == pytest.approx(by_graphs, rel=1e-6)
    assert result["samples"] == 8


def test_a_batch_object_that_cannot_move_itself_is_refused_with_the_forms_that_work():
    class Record:
        def __init__(self):
            self.x, self.y = torch.randn(4, FEATURES), torch.zeros(4, dtype=torch.long)

    with pytest.raises(TypeError, match=r"cannot use a batch of the form Record.*\.to\(device\).*\.y"):
        gk.evaluate(nn.Linear(FEATURES, CLASSES), [Record()], device=CPU)


def test_torch_geometric_batches_train_and_evaluate():
    torch_geometric = pytest.importorskip("torch_geometric")
    from torch_geometric.data import Data
    from torch_geometric.loader import DataLoader

    graphs = []
    for index, nodes in enumerate([2, 9, 3, 12, 2, 2, 3, 10]):
        batch = graph_batch([nodes], seed=index)
        graphs.append(Data(x=batch.x, edge_index=batch.edge_index, y=batch.y))
    loader = DataLoader(graphs, batch_size=3)
    assert isinstance(loader, torch.utils.data.DataLoader), torch_geometric.__version__
    model = GraphBatchModel()
    with torch.no_grad():
        by_hand = [F.cross_entropy(model(b), b.y, reduction="sum") for b in loader]
    result = gk.evaluate(model, loader, device=CPU)
    assert result["samples"] == 8
    assert result["loss"] == pytest.approx((sum(by_hand) / 8).item(), rel=1e-6)
    history = gk.fit(model, loader, epochs=1, log_every=1, progress=False, device=CPU)
    assert history.micro_batch_size == 3 and len(history.steps) == 3


# ---------------------------------------------------------------------------------------------
# Dataclass outputs


@dataclass
class Out:
    logits: torch.Tensor
    aux_loss: torch.Tensor


class DataclassExperts(nn.Module):
    """Logits and a load-balancing loss, returned as a dataclass (as a tuple they get fit's warning)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.router, self.head = nn.Linear(6, 2), nn.Linear(6, CLASSES)

    def forward(self, x):
        weights = self.router(x).softmax(-1)
        return Out(self.head(x) * weights[:, :1], 2 * (weights.mean(0) ** 2).sum())


def experts_data() -> list:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 6, generator=generator), torch.randint(0, CLASSES, (8,), generator=generator))] * 2


def test_a_dataclass_with_an_aux_loss_and_no_loss_fn_warns_naming_the_fix():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gk.fit(DataclassExperts(), experts_data(), max_steps=2, log_every=1, progress=False, device=CPU)
    (warned,) = [w for w in caught if "leaves out" in str(w.message)]
    message = str(warned.message)
    assert "outputs.aux_loss is a scalar tensor" in message
    assert "loss_fn=lambda outputs, target: F.cross_entropy(outputs.logits, target) + outputs.aux_loss" in message
    assert warned.filename == __file__

    def with_balance(outputs, target):
        return F.cross_entropy(outputs.logits, target) + outputs.aux_loss

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        options = dict(loss_fn=with_balance, max_steps=1, log_every=1, progress=False, device=CPU)
        history = gk.fit(DataclassExperts(), experts_data(), **options)
    assert not [w for w in caught if "leaves out" in str(w.message)]
    inputs, target = experts_data()[0]
    assert history.steps[0]["loss"] == pytest.approx(with_balance(DataclassExperts()(inputs), target).item())


@dataclass
class Losses:
    loss_classifier: torch.Tensor
    loss_box: torch.Tensor


class DataclassLosses(nn.Module):
    """A model that returns its losses as a dataclass of scalars, as a detector returns a dict of them."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(6, CLASSES)

    def forward(self, x, target):
        logits = self.head(x)
        return Losses(F.cross_entropy(logits, target), logits.pow(2).mean())


def test_a_dataclass_of_losses_is_summed_and_each_is_a_column_like_a_dict():
    inputs, target = experts_data()[0]
    data = [((inputs, target), target)]
    history = gk.fit(DataclassLosses(), data, max_steps=1, log_every=1, progress=False, device=CPU)
    expected = DataclassLosses()(inputs, target)
    row = history.steps[0]
    assert row["loss_classifier"] == pytest.approx(expected.loss_classifier.item())
    assert row["loss"] == pytest.approx((expected.loss_classifier + expected.loss_box).item())
    flops = gk.bench.flops_per_step(DataclassLosses(), data[0])
    assert flops > 0


# ---------------------------------------------------------------------------------------------
# A model call that fails on the training data


class Policy(nn.Module):
    """A policy of observations alone: forward(obs) -> (B, actions) logits."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(FEATURES, 2)

    def forward(self, obs):
        return self.layer(obs)


def rollouts() -> list:
    generator = torch.Generator().manual_seed(0)
    obs = torch.randn(8, FEATURES, generator=generator)
    actions, returns = torch.randint(0, 2, (8,), generator=generator), torch.randn(8, generator=generator)
    return [(obs, actions, returns)]


def policy_gradient(logits, target):
    """-log π(action | obs) × return, averaged; target (B, 2): the action and the return of each step."""
    chosen = logits.log_softmax(-1).gather(1, target[:, :1].long()).squeeze(1)
    return -(chosen * target[:, 1]).mean()


@pytest.mark.parametrize("where", ["train_data", "eval_data"])
def test_a_model_call_that_fails_is_explained_before_training_on_either_data(where):
    model = Policy()
    before = model.layer.weight.clone()
    data = {"train_data": rollouts(), "eval_data": None}
    if where == "eval_data":
        obs, actions, returns = rollouts()[0]
        data = {"train_data": [(obs, torch.stack([actions.float(), returns], 1))], "eval_data": rollouts()}
    with pytest.raises(ValueError) as raised:
        options = dict(loss_fn=policy_gradient, max_steps=1, progress=False, device=CPU)
        gk.fit(model, data["train_data"], eval_data=data["eval_data"], **options)
    message = " ".join(str(raised.value).split())
    source = "the training data's" if where == "train_data" else "eval_data's"
    assert f"the model failed on {source} first batch" in message
    assert "forward() takes 2 positional arguments but 3 were given" in message
    assert "called as model(inputs[0], inputs[1])" in message  # how the batch was split and called
    assert "target (8,) float32" in message
    assert "torch.stack" in message and "loss_fn" in message  # what to pass instead
    assert torch.equal(model.layer.weight, before), "an optimizer step ran before the mistake was reported"


def test_the_form_the_message_suggests_trains_the_policy():
    obs, actions, returns = rollouts()[0]
    data = [(obs, torch.stack([actions.float(), returns], 1))]
    history = gk.fit(Policy(), data, loss_fn=policy_gradient, max_steps=1, log_every=1, progress=False, device=CPU)
    assert history.steps[0]["loss"] == pytest.approx(policy_gradient(Policy()(obs), data[0][1]).item())


# ---------------------------------------------------------------------------------------------
# Cross-entropy that cannot match the outputs


def test_evaluate_without_loss_fn_on_outputs_cross_entropy_cannot_match_names_loss_fn():
    data = [(torch.randn(8, FEATURES), torch.randint(0, 3, (8, 2)))]
    with pytest.raises(ValueError, match=r"cannot match outputs of shape \(8, 3\).*pass loss_fn="):
        gk.evaluate(nn.Linear(FEATURES, 3), data, device=CPU)


# ---------------------------------------------------------------------------------------------
# CTC, as the README's line shows it


class Recognizer(nn.Module):
    """Frames (B, T, F) → log-probabilities (T, B, C) for CTC, with each utterance's frame count."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(FEATURES, 5)  # 5 symbols, blank (0) included

    def forward(self, features, lengths, labels=None):  # labels: the target, for the loss_fn, not the model
        return {"log_probs": self.layer(features).log_softmax(-1).transpose(0, 1), "lengths": lengths}


def ctc(outputs, labels):
    """CTC of labels (B, S) padded with -100: the padding is no symbol (clamped to blank, beyond each length)."""
    lengths = (labels >= 0).sum(1)
    return F.ctc_loss(outputs["log_probs"], labels.clamp(min=0), outputs["lengths"], lengths)


def test_a_ctc_dict_batch_with_lengths_trains_with_a_loss_fn_and_counts_utterances():
    generator = torch.Generator().manual_seed(0)
    labels = torch.tensor([[1, 2, 3], [4, 1, -100]])  # two utterances, 3 and 2 symbols
    features = torch.randn(2, 10, FEATURES, generator=generator)
    batch = {"features": features, "lengths": torch.tensor([10, 7]), "labels": labels}
    history = gk.fit(Recognizer(), [batch], loss_fn=ctc, max_steps=1, log_every=1, progress=False, device=CPU)
    assert history.micro_batch_size == 2 and history.sample_name == "sequence"
    assert history.steps[0]["loss"] == pytest.approx(ctc(Recognizer()(**batch), labels).item(), rel=1e-6)
    assert gk.evaluate(Recognizer(), [batch], loss_fn=ctc, device=CPU)["tokens"] == 5  # scored symbols
