"""Character-level data for the gradlog demo: the bundled corpus and a windowed dataset.

The dataset is made of *non-overlapping* windows of the text, so a window index is a stable
identifier of one training example ("datum") across steps and epochs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from importlib.resources import files

import torch

from gradlog.errors import InputError

__all__ = ["CharCorpus", "load_corpus"]


def load_corpus() -> str:
    """Return the bundled training text (Shakespeare's Sonnets, public domain).

    Returns:
        The contents of ``gradlog/demo/corpus.txt`` as a string.
    """
    return files("gradlog.demo").joinpath("corpus.txt").read_text(encoding="utf-8")


class CharCorpus:
    """A text encoded at the character level, split into non-overlapping windows.

    Args:
        text: The training text; must contain at least two characters.

    Attributes:
        text: The original text.
        vocab: Sorted list of the unique characters of ``text``.
        data: The whole text encoded as a 1-D ``torch.long`` tensor.
    """

    def __init__(self, text: str) -> None:
        if len(text) < 2:
            raise ValueError(
                f"CharCorpus needs a text of at least 2 characters, got {len(text)}; "
                "pass a longer text (e.g. load_corpus())."
            )
        self.text = text
        self.vocab: list[str] = sorted(set(text))
        self._stoi = {ch: i for i, ch in enumerate(self.vocab)}
        self.data = self.encode(text)  # (N,)

    @property
    def vocab_size(self) -> int:
        """Number of distinct characters."""
        return len(self.vocab)

    def encode(self, s: str) -> torch.Tensor:
        """Encode a string as a 1-D ``torch.long`` tensor of character ids.

        Raises:
            ValueError: If ``s`` contains a character that is not in the vocabulary.
        """
        try:
            ids = [self._stoi[ch] for ch in s]
        except KeyError as err:
            raise ValueError(
                f"character {err.args[0]!r} is not in the corpus vocabulary; "
                "only encode text made of characters that occur in the corpus."
            ) from None
        return torch.tensor(ids, dtype=torch.long)

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        """Decode a sequence (1-D tensor or list) of character ids back to a string."""
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        return "".join(self.vocab[int(i)] for i in ids)

    def _check_block_size(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}.")
        if block_size + 1 > len(self.data):
            raise ValueError(
                f"block_size={block_size} is too long for a corpus of {len(self.data)} "
                "characters; use a smaller block_size."
            )

    def dataset(self, block_size: int) -> int:
        """Return the number of non-overlapping windows of length ``block_size``.

        Window ``i`` covers characters ``[i * block_size, i * block_size + block_size]``
        (one extra character for the shifted target), so the count is
        ``(len(text) - 1) // block_size``.
        """
        self._check_block_size(block_size)
        return (len(self.data) - 1) // block_size

    def window(self, i: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return window ``i`` as an ``(x, y)`` pair of 1-D ``torch.long`` tensors.

        ``x`` holds characters ``[i * block_size, i * block_size + block_size)`` and ``y`` the
        same span shifted by one character (the next-character targets).

        Raises:
            IndexError: If ``i`` is not a valid window index.
        """
        n = self.dataset(block_size)
        if not 0 <= i < n:
            raise IndexError(f"window index {i} out of range [0, {n}) for block_size={block_size}")
        start = i * block_size
        x = self.data[start : start + block_size]  # (T,)
        y = self.data[start + 1 : start + block_size + 1]  # (T,)
        return x, y

    def batches(
        self, batch_size: int, block_size: int, steps: int, seed: int = 0,
        windows: int | None = None,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Yield ``steps`` training batches, deterministically given ``seed``.

        Window indices are shuffled once per epoch with a seeded ``torch.Generator`` and
        consumed in order, so each datum appears once per epoch and at many steps overall.
        A batch never contains the same window twice: when the rest of an epoch cannot fill
        a whole batch, that tail is dropped and the next epoch starts with a fresh shuffle.

        Args:
            batch_size: Number of windows per batch ``B``; at most ``dataset(block_size)``.
            block_size: Window length ``T``.
            steps: Number of batches to yield.
            seed: Seed of the shuffling generator.
            windows: Train on the first ``windows`` windows only (a small data set seen over
                several epochs); None: every window of the corpus.

        Yields:
            ``(x, y, datum_ids)`` with ``x`` and ``y`` of shape ``(B, T)`` (long) and
            ``datum_ids`` of shape ``(B,)`` (long) holding the window indices.
        """
        n = self.dataset(block_size)
        if windows is not None:
            if not 1 <= windows <= n:
                raise InputError(
                    f"windows must be in [1, {n}] (the corpus has {n} windows of "
                    f"block_size={block_size}), got {windows!r}."
                )
            n = windows
        if batch_size <= 0 or batch_size > n:
            raise ValueError(
                f"batch_size must be in [1, {n}] (the number of windows for "
                f"block_size={block_size}), got {batch_size!r}."
            )
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps!r}.")
        gen = torch.Generator().manual_seed(seed)
        text = self.data[: n * block_size + 1]  # (n * T + 1,)
        order = torch.randperm(n, generator=gen)  # (n,)
        pos = 0
        for _ in range(steps):
            if pos + batch_size > n:
                # Start a new epoch: reshuffle and drop the incomplete tail.
                order = torch.randperm(n, generator=gen)  # (n,)
                pos = 0
            ids = order[pos : pos + batch_size]  # (B,)
            pos += batch_size
            starts = ids * block_size  # (B,)
            offsets = torch.arange(block_size)  # (T,)
            x = text[starts[:, None] + offsets[None, :]]  # (B, T)
            y = text[starts[:, None] + offsets[None, :] + 1]  # (B, T)
            yield x, y, ids.clone()
