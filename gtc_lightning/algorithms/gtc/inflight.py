"""The one-step-stale exchange's update in flight (:class:`InFlight`): launched at one step, applied at a
later one, saved in checkpoints as a vector in parameter order and carried over to a new set of
parameters by name. :mod:`gtc_lightning.algorithms.gtc.stale` launches and applies it; the state
keeps it, pickles it and restores it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gtc_lightning.algorithms.common import finish
from gtc_lightning.algorithms.gtc.decode import decode_coded, valid_words, votes


@dataclass
class InFlight:
    """An exchange launched at one step, applied at a later one.

    Attributes:
        step: the optimizer step that launched it.
        kind: ``"sparse"`` (words: vote counts times ``tau / world``) or ``"dense"`` (sums of the ranks'
            residual + gradient, divided by ``world``).
        world: the ranks that took part.
        tau32: sparse: the float32 tau the words were thresholded with (automatic tau moves it
            before they are applied).
        work: the collective's handle until it was waited for.
        words: sparse: the received words, ``[m]`` or ``[W * width]`` with ``lengths``.
        lengths: valid words per row of a padded all-gather, else None.
        coded: sparse with ``coding="rice"``: the received bytes until decoded into ``words``; ``own``:
            ``(rank, words)``, this rank's own words, taken as they are rather than decoded.
        sizes: the ranks' coded message bytes; ``width``: the padded row length of an all-gather of
            coded messages, else None.
        sums: dense: ``[capacity]`` float32 sums, laid out as ``slots``.
        slots: the flat layout it was launched in (parameter name -> (offset, numel)).
        vector: ``[sum(numels)]`` float32 in parameter order (vote counts or sums), when restored
            from a checkpoint.
    """

    step: int
    kind: str
    world: int
    tau32: float | None = None
    work: Any = None
    words: torch.Tensor | None = None
    lengths: list[int] | None = None
    coded: torch.Tensor | None = None
    own: tuple[int, torch.Tensor] | None = None
    sizes: list[int] | None = None
    width: int | None = None
    sums: torch.Tensor | None = None
    slots: dict | None = None
    vector: torch.Tensor | None = None

    def wait(self, busy: bool = False) -> None:
        """Wait for the collective, if it is still running (``busy``: poll it, as ``common.finish``)."""
        if self.work is not None:
            finish(self.work, busy)
            self.work = None

    def received_words(self) -> None:
        """A Rice-coded exchange's words, decoded (``coded`` -> ``words``); call once it was waited for."""
        if self.coded is None:
            return
        self.words, self.lengths = decode_coded(self.coded, self.sizes, self.width, own=self.own), None
        self.coded = self.own = self.sizes = self.width = None

    def vector_in(self, names: list[str], numels: list[int]) -> torch.Tensor:
        """The update as ``[sum(numels)]`` float32 in the order of ``names``: vote counts (sparse) or
        sums (dense), zero for parameters outside its layout. Waits for it first."""
        if self.vector is not None:
            return self.vector
        self.wait()
        self.received_words()
        flat = votes(valid_words(self.words, self.lengths), sum(numels)) if self.kind == "sparse" else self.sums
        parts = []
        for name, n in zip(names, numels):
            offset, _ = self.slots.get(name, (None, n))
            parts.append(flat[offset : offset + n] if offset is not None else flat.new_zeros(n))
        return torch.cat(parts) if parts else flat.new_zeros(0)

    def entry(self, names: list[str], numels: list[int], tau32: float) -> dict:
        """For a checkpoint: ``{"step", "kind", "world", "vector", "tau32"}`` (``tau32``: what a vote of a
        sparse update is worth times ``world``, the state's ``tau32`` when the flight has none; None for
        a dense one). Waits for it first."""
        vector = self.vector_in(names, numels).to("cpu", copy=True)
        tau32 = None if self.kind == "dense" else (tau32 if self.tau32 is None else self.tau32)
        return {"step": self.step, "kind": self.kind, "world": self.world, "vector": vector, "tau32": tau32}

    @classmethod
    def from_entry(cls, entry: dict, device: torch.device) -> InFlight:
        """A checkpoint's pending entry (:meth:`entry`) as an update to apply at the next step."""
        vector = entry["vector"].to(device=device, dtype=torch.float32)
        # tau32 None: a checkpoint from before tau was saved with it (fixed tau)
        return cls(step=entry["step"], kind=entry["kind"], world=entry["world"], tau32=entry.get("tau32"), vector=vector)

    def by_name(self, names: list[str], numels: list[int]) -> dict[str, torch.Tensor]:
        """The update per parameter name (waited for), before the state is bound to other parameters."""
        return dict(zip(names, self.vector_in(names, numels).split(numels)))

    def reordered(self, parts: dict[str, torch.Tensor], names: list[str], numels: list[int]) -> InFlight:
        """This update (``parts``, from :meth:`by_name`) as a vector in the order of ``names`` (zero for
        new parameters), applied through the generic path at the next step, in whatever layout DDP
        builds then."""
        like = next(iter(parts.values()), None)
        device = like.device if like is not None else "cpu"
        vector = torch.cat(
            [
                parts[name] if name in parts and parts[name].numel() == n else torch.zeros(n, device=device)
                for name, n in zip(names, numels)
            ]
        ) if numels else torch.zeros(0)  # fmt: skip
        return InFlight(step=self.step, kind=self.kind, world=self.world, tau32=self.tau32, vector=vector)
