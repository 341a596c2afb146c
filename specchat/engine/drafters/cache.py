"""The drafters of one engine, by name: built on first use, then shared by every request that names them."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from specchat.engine.drafters.base import Drafter

if TYPE_CHECKING:
    from specchat.engine.sequence import Sequence


class DrafterCache:
    """Drafters by name (`none`, `ngram`, `heads:FILE`, ...); `build` makes the ones not seen yet."""

    def __init__(self, build: Callable[[str], Drafter]) -> None:
        self.build = build
        self.by_name: dict[str, Drafter] = {}

    def get(self, name: str) -> Drafter:
        """The drafter called `name`, built now if needed (an unknown name raises ConfigError here)."""
        if name not in self.by_name:
            self.by_name[name] = self.build(name)
        return self.by_name[name]

    def __setitem__(self, name: str, drafter: Drafter) -> None:
        """Register a ready drafter under a name (trained heads in memory, tests)."""
        self.by_name[name] = drafter

    def __getitem__(self, name: str) -> Drafter:
        return self.get(name)

    def release(self, seq: Sequence) -> None:
        """Drop what the request's drafter keeps for it (the request finished, was preempted or switched)."""
        self.get(seq.spec.drafter).release(seq)

    def follow_weights(self, fmt: str) -> None:
        """The target's weights switched to `fmt`: every drafter built so far hears it (`Drafter.follow_weights`)."""
        for drafter in list(self.by_name.values()):  # (a copy: another thread may build one meanwhile)
            drafter.follow_weights(fmt)

    def taps(self, seqs: Iterable[Sequence]) -> tuple[int, ...]:
        """Target layers whose hidden states the requests' drafters read, sorted."""
        names = {seq.spec.drafter for seq in seqs}
        return tuple(sorted({tap for name in names for tap in self.get(name).taps}))
