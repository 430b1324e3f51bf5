"""Text as byte-level tokens, served as (B, T) windows with next-token targets.

- `text()`: local text files → byte tokens (a vocabulary of 256: every file is readable, no
  tokenizer to download), split into a training and a held-out part. The default corpus is the
  Python standard library's own source, which every machine with Python has: real text, offline.
- `TokenDataset`: the tokens as one uint8 tensor; window i is (tokens[i·T : i·T+T], the same
  shifted by one), so it also works with PyTorch's DataLoader.
- `TextLoader`: the DeviceLoader for text: the tokens live on the device, and each epoch takes
  every window once from a random offset in a random order, on the device.
"""

from __future__ import annotations

import copy
import math
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch.utils.data import Dataset

from ..env import resolve_device
from ..validation import check_int, check_seed

VOCAB_SIZE = 256  # one token per byte


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of `text` as a uint8 tensor of tokens."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).clone()


def decode(tokens) -> str:
    """Tokens (any integer tensor or sequence of 0..255) back to text; broken UTF-8 shows as �."""
    values = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
    return bytes(int(v) for v in values).decode("utf-8", errors="replace")


class TokenDataset(Dataset):
    """Byte tokens (uint8, shape (N,)) cut into windows of `seq_len` with next-token targets.

    Item i is (inputs, target), each int64 of shape (seq_len,): tokens[i·T : i·T + T] and the
    same window shifted one token ahead. There are (N - 1) // seq_len windows.
    """

    vocab_size = VOCAB_SIZE

    def __init__(self, tokens: torch.Tensor, seq_len: int, name: str = "text"):
        if not isinstance(tokens, torch.Tensor) or tokens.dtype != torch.uint8 or tokens.dim() != 1:
            raise ValueError("tokens must be a 1-D uint8 tensor of bytes; use gk.data.encode(text) to make one.")
        check_int("seq_len", seq_len)
        if len(tokens) < seq_len + 1:
            raise ValueError(
                f"{name} has {len(tokens):,} tokens, fewer than seq_len + 1 = {seq_len + 1:,} (a window and its "
                "next-token targets); use more text or a shorter seq_len."
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.name = name

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"window {index} is out of range for {len(self)} windows.")
        start = (index % len(self)) * self.seq_len
        window = self.tokens[start : start + self.seq_len + 1].long()
        return window[:-1], window[1:]

    def decode(self, tokens) -> str:
        return decode(tokens)

    def __repr__(self) -> str:
        return f"TokenDataset({self.name}: {len(self.tokens):,} byte tokens, {len(self)} windows of {self.seq_len})"


def _files(paths, pattern: str) -> list[Path]:
    """The files behind `paths` (files, or folders searched recursively for `pattern`), sorted."""
    if paths is None:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        return sorted(path for path in stdlib.glob("*.py") if path.is_file())
    if isinstance(paths, (str, Path)):
        paths = [paths]
    files = []
    for path in map(Path, paths):
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            found = sorted(
                file
                for file in path.rglob(pattern)
                if file.is_file() and not any(part.startswith(".") for part in file.relative_to(path).parts)
            )
            if not found:
                raise FileNotFoundError(
                    f"no files matching {pattern!r} in {path.resolve()}; check the folder or pattern."
                )
            files += found
        else:
            raise FileNotFoundError(f"{path} is neither a file nor a folder; pass text files or folders of them.")
    if not files:
        raise FileNotFoundError(
            "no text files given; pass a file, a folder, or a list of them (or None for the default)."
        )
    return files


def text(
    paths: str | Path | Sequence[str | Path] | None = None,
    *,
    seq_len: int = 128,
    held_out: float = 0.1,
    max_bytes: int | None = None,
    pattern: str = "*",
) -> tuple[TokenDataset, TokenDataset]:
    """Byte tokens of text files, as (train, held-out) TokenDatasets of `seq_len` windows.

    paths:     a file, a folder (searched recursively for `pattern`, hidden files skipped), or a
               list of them; default the Python standard library's top-level *.py files.
    held_out:  the fraction of the bytes at the end of the corpus (files in sorted order) kept
               for evaluation: text the model never trains on.
    max_bytes: read files in order until this many bytes (for small runs).
    """
    if not 0 < held_out < 1:
        raise ValueError(f"held_out must be a fraction between 0 and 1, got {held_out!r}.")
    if max_bytes is not None and max_bytes < 2:
        raise ValueError(f"max_bytes must be at least 2, got {max_bytes!r}.")
    chunks, total = [], 0
    for path in _files(paths, pattern):
        data = path.read_bytes()
        if max_bytes is not None:
            data = data[: max_bytes - total]
        chunks.append(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    tokens = (
        torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8) if total else torch.empty(0, dtype=torch.uint8)
    )
    split = int(len(tokens) * (1 - held_out))
    name = "the standard library's source" if paths is None else "the text"
    return (
        TokenDataset(tokens[:split].clone(), seq_len, f"the training part of {name}"),
        TokenDataset(tokens[split:].clone(), seq_len, f"the held-out part of {name}"),
    )


class TextLoader:
    """(inputs, target) batches of shape (B, T) from a TokenDataset kept on the device.

    Each epoch starts the windows at a random offset (so windows differ between epochs) and
    takes them in a random order, from a generator seeded with (seed, epoch): an epoch can be
    replayed exactly, and every rank of a distributed job agrees on the order and takes its own
    interleaved share (`rank`, `world_size`). Without shuffling, windows come in order from 0.
    """

    def __init__(
        self,
        dataset: TokenDataset,
        batch_size: int,
        *,
        shuffle: bool = True,
        drop_last: bool | None = None,
        device: str | torch.device | None = None,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ):
        if not isinstance(dataset, TokenDataset):
            raise TypeError(f"TextLoader takes a TokenDataset (from gk.data.text()), got {type(dataset).__name__}.")
        check_int("batch_size", batch_size)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must lie in 0..world_size-1, got rank={rank}, world_size={world_size}.")
        self.device = resolve_device(device)
        self.dataset = dataset
        self.batch_size = batch_size
        self.seq_len = dataset.seq_len
        self.shuffle = shuffle
        self.drop_last = shuffle if drop_last is None else drop_last
        self.seed = check_seed(seed)
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        self.tokens = dataset.tokens.to(self.device)  # uint8: 8× less memory than int64
        # The order is drawn on the CPU on every device: CUDA's generator gives other numbers for the same
        # seed, and a run must see the same windows on a GPU as on the CPU (or as its DDP ranks on CPUs).
        self.generator = torch.Generator()
        self.offsets = torch.arange(self.seq_len + 1, device=self.device)  # (T + 1,): a window and its last target

    @property
    def windows(self) -> int:
        """Windows per epoch for this rank."""
        return len(self.dataset) // self.world_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def for_rank(self, rank: int, world_size: int) -> TextLoader:
        """This loader for one rank of a distributed job: the same tokens on the device, its own share."""
        if world_size == self.world_size and rank == self.rank:
            return self
        if self.world_size != 1:
            raise ValueError(f"the TextLoader is sharded for {self.world_size} ranks but the job has {world_size}.")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must lie in 0..world_size-1, got rank={rank}, world_size={world_size}.")
        sharded = copy.copy(self)  # shares the tokens already on the device
        sharded.rank, sharded.world_size = rank, world_size
        sharded.generator = torch.Generator()
        return sharded

    def __len__(self) -> int:
        if self.drop_last:
            return self.windows // self.batch_size
        return math.ceil(self.windows / self.batch_size)

    def _starts(self) -> torch.Tensor:
        """First token of every window of this epoch, for this rank."""
        count = len(self.dataset)
        if self.shuffle:
            self.generator.manual_seed(self.seed * 1_000_003 + self.epoch)
            spare = len(self.tokens) - 1 - count * self.seq_len  # tokens left over after the last window
            offset = int(torch.randint(0, spare + 1, (), generator=self.generator))
            order = torch.randperm(count, generator=self.generator).to(self.device)
        else:
            offset, order = 0, torch.arange(count, device=self.device)
        starts = offset + order * self.seq_len
        return starts[self.rank : self.windows * self.world_size : self.world_size]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        starts = self._starts()
        for first in range(0, len(self) * self.batch_size, self.batch_size):
            windows = self.tokens[starts[first : first + self.batch_size, None] + self.offsets].long()  # (B, T + 1)
            yield windows[:, :-1], windows[:, 1:]
        self.epoch += 1

    def __repr__(self) -> str:
        return (
            f"TextLoader({len(self.dataset.tokens):,} tokens on {self.device}, batch_size={self.batch_size}, "
            f"seq_len={self.seq_len}, shuffle={self.shuffle}, {len(self)} batches)"
        )
