"""gradlog.backends.heap: glibc's heap kept resident once per process, and when it is not."""

from __future__ import annotations

from typing import Any

import pytest

import gradlog.backends.heap as heap


class FakeLibc:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 1


@pytest.fixture
def libc(monkeypatch: pytest.MonkeyPatch) -> FakeLibc:
    fake = FakeLibc()
    monkeypatch.setattr(heap, "_done", None)
    monkeypatch.setattr(heap, "_libc", lambda: fake)
    for name in (heap.ENV, *heap._USER_TUNED):
        monkeypatch.delenv(name, raising=False)
    return fake


def test_sets_threshold_and_pad_once(libc: FakeLibc) -> None:
    assert heap.keep_heap_resident()
    assert heap.keep_heap_resident()  # the second call changes nothing
    assert libc.calls == [(heap._M_MMAP_THRESHOLD, 32 << 20),
                          (heap._M_TOP_PAD, heap.DEFAULT_PAD_MB << 20)]


@pytest.mark.parametrize(("value", "pad"), [("8", 8 << 20), ("0.5", 1 << 19), ("x", 32 << 20)])
def test_pad_from_the_environment(libc: FakeLibc, monkeypatch: pytest.MonkeyPatch,
                                  value: str, pad: int) -> None:
    monkeypatch.setenv(heap.ENV, value)
    assert heap.keep_heap_resident()
    assert libc.calls[-1] == (heap._M_TOP_PAD, pad)


@pytest.mark.parametrize("env", [(heap.ENV, "0"), ("MALLOC_TOP_PAD_", "1000"),
                                 ("MALLOC_TRIM_THRESHOLD_", "1")])
def test_skipped_when_disabled_or_tuned_by_the_user(libc: FakeLibc,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     env: tuple[str, str]) -> None:
    monkeypatch.setenv(*env)
    assert not heap.keep_heap_resident()
    assert libc.calls == []


def test_skipped_without_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap, "_done", None)
    monkeypatch.setattr(heap.platform, "libc_ver", lambda *a: ("musl", "1.2"))
    monkeypatch.delenv(heap.ENV, raising=False)
    for name in heap._USER_TUNED:
        monkeypatch.delenv(name, raising=False)
    assert not heap.keep_heap_resident()


def test_the_hooks_backend_applies_it_for_cpu_models(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch import nn

    from gradlog.backends.hooks import HooksBackend

    seen: list[Any] = []
    monkeypatch.setattr("gradlog.backends.hooks.keep_heap_resident", lambda: seen.append(1))
    model = nn.Linear(3, 2)
    be = HooksBackend(model, dict(model.named_parameters()), batch_reduction="mean",
                      randomness="different")
    be.attach()
    be.detach()
    assert seen == [1]
