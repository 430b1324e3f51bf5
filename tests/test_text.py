"""Byte-level text: the corpus, its windows, and the loader that keeps it on the device."""

import sysconfig
from pathlib import Path

import pytest
import torch

import gpukit as gk
from gpukit.data import TextLoader, TokenDataset, decode, encode


def test_default_corpus_is_the_standard_librarys_own_source():
    train, test = gk.data.text(seq_len=32, max_bytes=200_000)
    first = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[0].read_bytes()
    assert bytes(train.tokens[:100].tolist()) == first[:100]  # real text, read as bytes
    assert len(train.tokens) + len(test.tokens) == 200_000
    assert abs(len(test.tokens) / 200_000 - 0.1) < 1e-4  # the last tenth is held out
    assert train.vocab_size == 256 and train.tokens.dtype == torch.uint8


def test_windows_are_next_token_pairs(tmp_path):
    (tmp_path / "a.txt").write_text("abcdefghij")
    (tmp_path / "b.txt").write_text("klmnopqrst")
    train, test = gk.data.text(tmp_path, seq_len=3, held_out=0.2)
    assert decode(train.tokens) == "abcdefghijklmnop" and decode(test.tokens) == "qrst"  # files in sorted order
    assert len(train) == (16 - 1) // 3
    inputs, target = train[1]
    assert decode(inputs) == "def" and decode(target) == "efg"
    assert inputs.dtype == torch.long and target.dtype == torch.long
    assert decode(train[-1][0]) == "mno"
    with pytest.raises(IndexError):
        train[len(train)]


def test_encode_and_decode_round_trip():
    text = "naïve café — ok"
    assert decode(encode(text)) == text
    assert decode([0xFF, 0x41]) == "\ufffdA"  # broken UTF-8 shows as a replacement character


def test_a_folder_is_searched_recursively_without_hidden_files(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "one.md").write_text("x" * 50)
    (tmp_path / ".hidden.md").write_text("y" * 50)
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config.md").write_text("z" * 50)
    (tmp_path / "notes.txt").write_text("w" * 50)
    train, test = gk.data.text(tmp_path, seq_len=4, pattern="*.md")
    assert set(decode(train.tokens) + decode(test.tokens)) == {"x"}


def test_loader_covers_every_window_once_per_epoch_from_a_random_offset(device):
    tokens = torch.arange(1000, dtype=torch.int64) % 256
    dataset = TokenDataset(tokens.to(torch.uint8), 10)
    loader = TextLoader(dataset, 8, device=device, seed=3)
    assert len(loader) == len(dataset) // 8 == 12
    epochs = []
    for _ in range(2):
        starts = []
        for inputs, target in loader:
            assert inputs.shape == target.shape == (8, 10) and inputs.device == device
            assert torch.equal(target[:, :-1], inputs[:, 1:])  # targets are the inputs shifted by one token
            starts += inputs[:, 0].tolist()
        epochs.append(starts)
    for starts in epochs:
        assert len(set(starts)) == len(starts) == 96  # no window twice in an epoch
    assert epochs[0] != epochs[1]  # a new order and offset each epoch
    loader.set_epoch(0)
    assert [x[:, 0].tolist() for x, _ in loader] == [epochs[0][i : i + 8] for i in range(0, 96, 8)]  # replayable


def test_loader_without_shuffle_reads_the_windows_in_order(device):
    dataset = TokenDataset(torch.arange(101, dtype=torch.uint8), 10)
    loader = TextLoader(dataset, 4, shuffle=False, device=device)
    batches = list(loader)
    assert len(batches) == 3 and batches[-1][0].shape == (2, 10)  # 10 windows: 4 + 4 + 2
    assert torch.equal(batches[0][0][1], dataset[1][0])


def test_ranks_share_out_the_windows(device):
    dataset = TokenDataset(torch.randint(0, 256, (2001,), dtype=torch.uint8), 10)
    whole = TextLoader(dataset, 4, device=device, seed=1)
    shards = [whole.for_rank(rank, 2) for rank in range(2)]
    assert whole.world_size == 1 and all(len(shard) == len(whole) // 2 for shard in shards)
    seen = [torch.cat([x for x, _ in shard]) for shard in shards]
    both = torch.cat(seen)
    assert len({tuple(row.tolist()) for row in both}) == len(both)  # disjoint
    everything = torch.cat([x for x, _ in whole])  # one epoch of the unsharded loader
    merged = torch.empty_like(everything)
    merged[0::2], merged[1::2] = seen  # rank 0 takes positions 0, 2, 4…, rank 1 takes 1, 3, 5…
    assert torch.equal(merged, everything)
    with pytest.raises(ValueError, match="sharded for 2 ranks but the job has 4"):
        shards[0].for_rank(0, 4)


def test_bad_input_says_what_to_do(tmp_path, device):
    with pytest.raises(FileNotFoundError, match="neither a file nor a folder"):
        gk.data.text(tmp_path / "missing.txt")
    with pytest.raises(FileNotFoundError, match="no files matching"):
        gk.data.text(tmp_path)
    (tmp_path / "short.txt").write_text("tiny")
    with pytest.raises(ValueError, match=r"has 3 tokens, fewer than seq_len \+ 1 = 9.*shorter seq_len"):
        gk.data.text(tmp_path / "short.txt", seq_len=8, held_out=0.25)
    with pytest.raises(ValueError, match="held_out must be a fraction"):
        gk.data.text(tmp_path / "short.txt", held_out=0)
    dataset = TokenDataset(torch.zeros(100, dtype=torch.uint8), 8)
    with pytest.raises(ValueError, match="1-D uint8 tensor"):
        TokenDataset(torch.zeros(100, dtype=torch.long), 8)
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        TextLoader(dataset, 0, device=device)
    with pytest.raises(TypeError, match="TextLoader takes a TokenDataset"):
        TextLoader(torch.utils.data.TensorDataset(torch.zeros(4)), 2, device=device)


def test_a_window_longer_than_the_model_allows_is_a_clear_error(device):
    train, _ = gk.data.text(seq_len=64, max_bytes=20_000)
    model = gk.models.gpt(max_seq_len=32, width=16, depth=1, heads=2)
    with pytest.raises(ValueError, match="sequence length 64 is above the model's maximum 32"):
        gk.fit(model, train, batch_size=4, max_steps=1, progress=False, device=device)
