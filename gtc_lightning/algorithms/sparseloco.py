"""A compressed block sync, torch only: BMUF's block update (DiLoCo's pseudo-gradient) sent as GTC words.
It joins the two algorithm families (BMUF's state from :mod:`.averaging`, GTC's threshold, words, coding and
collectives from :mod:`.gtc`), which do not import each other, so it sits beside them.

BMUF (:mod:`.averaging.bmuf`) all-reduces every rank's whole model at each block sync. Here each rank sends only the
largest elements of its block update, as Strom's GTC sends the largest elements of a gradient, and keeps
the rest for later blocks (error feedback), as SparseLoCo (Sarfi et al., "Communication Efficient LLM
Pre-training with SparseLoCo", 2025) does with DiLoCo's pseudo-gradient, and as the BMUF-GTC write-up
(Ladkat, Strom et al., 2019) does with GTC within its groups. At a block sync, per rank:

1. u = the rank's model - the block's start point (``W`` or ``W + ηΔ``, identical on every rank);
   ``residual = error_decay * residual + u`` (``error_decay`` 1: plain error feedback, nothing lost).
2. Threshold: ``tau_r`` just below the ``1 - density`` quantile of ``|residual|``
   (:func:`~gtc_lightning.algorithms.gtc.update.rank_tau`: a stratified sample, seeded by sync and rank),
   so that about ``density * n`` elements pass whatever the scale of the block's steps.
3. Words ``index | sign << 31`` of ``|residual| > tau_r`` in ascending order, each with a value, which
   is taken off the residual (``residual - sent`` is what the rank still owes):

   - ``values="sign"`` (Strom's 1 bit): ``±tau_r`` (:func:`~gtc_lightning.ops.torch_ops.emit_`);
   - ``values="2bit"``: the sign and one bit choosing the lower or upper of two magnitudes, the means of
     the sent ``|residual|`` below and above their own mean (SparseLoCo quantises to 2 bits);
   - ``values="float32"``: the element itself (top-k with exact values; at ``density=1`` this is BMUF).
4. One header per rank ``[words, index bytes, payload bytes, non-finite, level a, level b]`` to every
   rank, then every rank's payload: the words (Golomb-Rice coded gaps with ``coding="rice"``,
   :mod:`gtc_lightning.ops.rice`), then its values (nothing; the level bits; the float32 values), by
   GTC's collectives (:mod:`gtc_lightning.algorithms.gtc.exchange`: all-to-all on gloo).
5. Decode rank by rank in rank order: ``d[i] += value / W`` at each word (no index twice within a rank,
   a fixed order across ranks), so that every rank holds the same ``d``, bit for bit.
6. BMUF's filter on ``d``, the decoded mean of the block updates: ``Δ = ηΔ + ζ d``, ``W = W + Δ``; every
   rank starts the next block from ``W + ηΔ`` (Nesterov) or ``W``. With η = 0 (SparseLoCo's choice: its
   error feedback stands in for the outer momentum) the next start is ``start + ζ d``.

Replicas are bit-identical after every block sync without a broadcast; the residual is this rank's own
(saved in its checkpoint shard). Memory: W, Δ and the residual, 12 bytes per parameter beyond DDP's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer
from typing_extensions import override

from gtc_lightning.algorithms.averaging.bmuf import BMUFState
from gtc_lightning.algorithms.averaging.model_averaging import flatten, unflatten_
from gtc_lightning.algorithms.common import busy_wait_fits
from gtc_lightning.algorithms.gtc.config import CODINGS, EXCHANGES, f32
from gtc_lightning.algorithms.gtc.exchange import send_coded, send_header
from gtc_lightning.algorithms.gtc.update import rank_tau
from gtc_lightning.ops.rice import pack_words, rice_decode, rice_encode, unpack_words
from gtc_lightning.ops.torch_ops import INDEX_MASK, emit_, find_words

VALUES = ("sign", "2bit", "float32")
HEADER = 6  # int64 per rank: words, index bytes, payload bytes, non-finite elements, level a, level b (float64 bits)


def check_sparse_args(density: Any, values: Any, coding: Any, error_decay: Any, exchange: Any) -> None:
    """The compressed sync's options, with what each means."""
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0.0 < density <= 1.0:
        raise ValueError(
            f"Expect density in (0, 1] (the share of the block update's elements each rank sends per sync; "
            f"SparseLoCo sends 1-3 %, e.g. density=0.02), got {density!r}"
        )
    if values not in VALUES:
        raise ValueError(
            f"Expect values in {VALUES} ('sign': Strom's 1 bit, ±tau; '2bit': the sign and one of two magnitudes, "
            f"as SparseLoCo; 'float32': exact values), got {values!r}"
        )
    if coding not in CODINGS:
        raise ValueError(f"Expect coding in {CODINGS} (rice: Golomb-Rice coded index gaps), got {coding!r}")
    if (
        isinstance(error_decay, bool)
        or not isinstance(error_decay, (int, float))
        or not 0.0 <= error_decay <= 1.0
    ):
        raise ValueError(
            f"Expect error_decay in [0, 1] (what the residual keeps of itself at each sync: 1 keeps everything "
            f"not yet sent, 0 drops it), got {error_decay!r}"
        )
    if exchange not in EXCHANGES:
        raise ValueError(f"Expect exchange in {EXCHANGES}, got {exchange!r}")


@dataclass
class _Link:
    """What GTC's collectives read of a state: the group, this rank, how to wait, the coded payload."""

    process_group: dist.ProcessGroup | None
    world_size: int
    rank: int
    exchange: str
    busy: bool
    _coded: torch.Tensor | None = None


def _bits(value: float) -> int:
    """A float as the int64 of its float64 bits (a header holds int64 only)."""
    return int(torch.tensor([value], dtype=torch.float64).view(torch.int64))


def _float(bits: int) -> float:
    return float(torch.tensor([bits], dtype=torch.int64).view(torch.float64))


def select_(
    residual: torch.Tensor, tau32: float, values: str
) -> tuple[torch.Tensor, torch.Tensor, float, float, int]:
    """Steps 3 on this rank: the words of ``|residual| > tau32`` (ascending) and their values, which are
    taken off ``residual`` in place.

    Returns:
        ``(words [m] int32, value payload [B] uint8, level a, level b, non-finite elements)``; the levels are
        float32 values: ``(tau, 0)`` for ``"sign"``, the lower and upper magnitudes for ``"2bit"``, ``(0, 0)``
        for ``"float32"``, whose payload is the values themselves.
    """
    empty = torch.zeros(0, dtype=torch.uint8, device=residual.device)
    if values == "sign":  # Strom's words; ±tau taken off the residual
        message = torch.empty(residual.numel(), dtype=torch.int32, device=residual.device)
        cursor = torch.zeros(1, dtype=torch.int64, device=residual.device)
        bad = torch.zeros(1, dtype=torch.int32, device=residual.device)
        emit_(residual, tau32, message, cursor, bad)
        return message[: int(cursor)].clone(), empty, tau32, 0.0, int(bad)
    index, words, bad = find_words(residual, tau32)  # the residual is only read here
    if not words.numel() or bad:
        return words, empty, tau32, 0.0, bad
    exact = residual[index]
    if values == "float32":
        residual[index] = 0.0  # sent whole
        return words, exact.contiguous().view(torch.uint8), 0.0, 0.0, 0
    magnitude = exact.abs()
    upper = magnitude > magnitude.mean()
    low = f32(float(magnitude[~upper].mean()))
    high = f32(float(magnitude[upper].mean())) if bool(upper.any()) else low
    sent = torch.where(upper, high, low).to(torch.float32)
    residual[index] = exact - torch.where(exact < 0, -sent, sent)
    return words, pack_words(upper.long(), pad=0).view(torch.uint8), low, high, 0


def decode_values(
    words: torch.Tensor, payload: torch.Tensor, a: float, b: float, values: str
) -> torch.Tensor:
    """``[m]`` float32: the values a rank's words carry (step 5 before the division by W)."""
    m = words.numel()
    if values == "float32":
        magnitude = payload.view(torch.float32).abs()
    elif values == "2bit":
        upper = unpack_words(payload.view(torch.int32))[:m].bool()
        magnitude = torch.where(upper, b, a).to(torch.float32)
    else:
        magnitude = torch.full((m,), a, dtype=torch.float32, device=words.device)
    return torch.where(words < 0, -magnitude, magnitude)


class SparseLoCoState(BMUFState):
    """BMUF's state whose block sync sends each rank's block update as GTC words (module docstring).

    Args:
        period, block_momentum, block_lr, nesterov: as for :class:`BMUFState` (K, η, ζ).
        density: share of the elements each rank sends per sync, in (0, 1].
        values: ``"sign"``, ``"2bit"`` or ``"float32"`` (step 3).
        coding: ``"rice"`` (Golomb-Rice coded index gaps) or ``"none"`` (32-bit words).
        error_decay: β in ``residual = β residual + u``; 1 keeps everything not yet sent.
        exchange: as for GTC (``"auto"``: all-to-all on gloo, a padded all-gather elsewhere).
        busy_wait: poll the collectives (``None``: on gloo when each rank has a core).
        **kwargs: as for :class:`~gtc_lightning.algorithms.averaging.model_averaging.AveragingState`;
            ``optimizer_state="average"`` is refused (a dense all-reduce of the moments).
    """

    def __init__(
        self,
        period: int,
        block_momentum: float,
        block_lr: float = 1.0,
        nesterov: bool = True,
        density: float = 1 / 64,
        values: str = "2bit",
        coding: str = "rice",
        error_decay: float = 1.0,
        exchange: str = "auto",
        busy_wait: bool | None = None,
        **kwargs: Any,
    ) -> None:
        check_sparse_args(density, values, coding, error_decay, exchange)
        if kwargs.get("optimizer_state") == "average":
            raise ValueError(
                "optimizer_state='average' all-reduces the optimizers' moments densely at every sync, which a "
                "compressed sync exists to avoid; use 'keep' (DiLoCo, SparseLoCo) or 'reset'"
            )
        super().__init__(period, block_momentum, block_lr, nesterov, **kwargs)
        # The hyper-parameters.
        self.density = float(density)
        self.values = values
        self.coding = coding
        self.error_decay = float(error_decay)
        self.exchange_kind = exchange
        self.busy_wait = busy_wait
        # The internal state: this rank's residual, float32 [n] (None before the first block).
        self.residual: torch.Tensor | None = None
        self._sampler: torch.Generator | None = None
        self.totals["words"] = 0

    @override
    def begin(self, parameters: list[torch.Tensor]) -> None:
        super().begin(parameters)
        assert self.global_params is not None
        self.residual = torch.zeros(
            self.global_params.numel(), dtype=torch.float32, device=self.global_params.device
        )

    def _link(self, group: dist.ProcessGroup | None, in_thread: bool) -> _Link:
        """GTC's collectives on ``group``; a sync in a thread of its own (``overlap``) waits without polling,
        to leave the core to the local steps."""
        busy = False if in_thread else busy_wait_fits(group) if self.busy_wait is None else self.busy_wait
        return _Link(group, dist.get_world_size(group), dist.get_rank(group), self.exchange_kind, busy)

    def _tau(self, residual: torch.Tensor, link: _Link, step: int) -> float:
        """Step 2, from a sample seeded by the sync and the rank (a resumed run draws the same one)."""
        device = residual.device
        if self._sampler is None or self._sampler.device != device:
            self._sampler = torch.Generator(device=device)
        self._sampler.manual_seed(step * 1_000_003 + link.rank)
        return rank_tau(residual, self.density, None, self._sampler)

    @override
    def _move_to(self, device: torch.device) -> None:
        super()._move_to(device)
        assert self.residual is not None
        if self.residual.device != device:
            self.residual = self.residual.to(device)

    @override
    def mean_update(
        self, update: torch.Tensor, part: slice, group: dist.ProcessGroup | None, step: int
    ) -> tuple[torch.Tensor, int, int]:
        """Steps 1-5 on ``part`` of the model: ``update`` (this rank's block update of the part at the sync of
        optimizer step ``step``) into the
        part's residual, the threshold, the words and values, the exchange and the rank-ordered decode.
        Returns the decoded mean ``d`` (float32) and the bytes sent and received. Raises ``RuntimeError`` on
        every rank alike when some rank's block update holds a NaN or Inf (before any payload is sent)."""
        assert self.residual is not None
        residual = self.residual[part]
        link = self._link(group, in_thread=group is not self.process_group)
        world, rank, device = link.world_size, link.rank, residual.device

        # 1-3. This rank's block update into its residual, the threshold, the words and their values.
        if self.error_decay != 1.0:
            residual.mul_(self.error_decay)
        residual.add_(update.to(torch.float32))
        tau32 = self._tau(residual, link, step)
        if math.isfinite(tau32) and tau32 > 0.0:
            words, value_bytes, a, b, bad = select_(residual, tau32, self.values)
        else:  # nothing to send (all zero), or the sample met a NaN/Inf
            words, value_bytes, a, b = torch.zeros(0, dtype=torch.int32, device=device), None, 0.0, 0.0
            bad = 0 if tau32 == 0.0 else max(1, int((~torch.isfinite(residual)).sum()))
        if bad:
            words = words[:0]
        index_bytes = rice_encode(words) if self.coding == "rice" else words.view(torch.uint8)
        payload = index_bytes if value_bytes is None or bad else torch.cat([index_bytes, value_bytes])

        # 4. Headers, then payloads.
        header = torch.tensor(
            [words.numel(), index_bytes.numel(), payload.numel(), bad, _bits(a), _bits(b)],
            dtype=torch.int64, device=device,
        )  # fmt: skip
        headers = send_header(link, header).view(world, HEADER).cpu()
        bad_ranks = [r for r, n in enumerate(headers[:, 3].tolist()) if n]
        if bad_ranks:
            raise RuntimeError(
                f"{type(self).__name__}: at the block sync of optimizer step {step} the block update holds NaN "
                f"or Inf on rank(s) {bad_ranks}; every rank stops here, before any payload is sent. A local step "
                "diverged: lower the inner learning rate or the period, or clip the gradients (gradient_clip_val)"
            )
        counts, index_sizes, sizes = (headers[:, j].tolist() for j in range(3))
        link._coded = payload
        data, width, sent, received, _ = send_coded(link, sizes)
        parts = (
            data.split(sizes)
            if width is None
            else [row[:n] for row, n in zip(data.view(world, width), sizes)]
        )

        # 5. Decode rank by rank into d (in the update's memory: it is in the residual now).
        decoded = update.zero_() if update.dtype == torch.float32 else torch.zeros_like(residual)
        for r, payload_r in enumerate(parts):
            if not counts[r]:
                continue
            if r == rank:
                rank_words = words
            elif self.coding == "rice":
                rank_words = rice_decode(payload_r[: index_sizes[r]])
            else:
                rank_words = payload_r[: index_sizes[r]].view(torch.int32)
            a_r, b_r = _float(int(headers[r, 4])), _float(int(headers[r, 5]))
            votes = decode_values(rank_words, payload_r[index_sizes[r] :], a_r, b_r, self.values) / world
            decoded.index_add_(0, (rank_words & INDEX_MASK).long(), votes)
        self.totals["words"] += words.numel()
        header_bytes = (world - 1) * HEADER * 8 if world > 1 else 0
        return decoded, header_bytes + sent, header_bytes + received

    @override
    def exchange(self, params: list[torch.Tensor], optimizers: list[Optimizer]) -> tuple[int, int]:
        """Steps 1-6 (streamed by part with ``fragments``/``overlap``); returns (sent, received) bytes."""
        assert self.global_params is not None and self.delta is not None and self.residual is not None
        if self.streamed:
            return super().exchange(params, optimizers)
        local = flatten(params)
        self._move_to(local.device)
        whole = slice(None)
        # (local is this call's own copy: the update is made in it)
        update = local.to(self.global_params.dtype).sub_(self.start_point(whole)).to(torch.float32)
        decoded, sent, received = self.mean_update(update, whole, self.process_group, self.step)

        # 6. BMUF's filter on the decoded mean update; every rank moves to the same start point.
        self._filter_(whole, decoded)
        unflatten_(self.start_point(whole), params)
        if self.optimizer_state == "reset":
            for optimizer in optimizers:
                optimizer.state.clear()
        return sent, received

    @override
    def state_dict(self) -> dict:
        return {**super().state_dict(), "residual": self.residual}

    @override
    def load_state_dict(self, saved: dict) -> None:
        super().load_state_dict(saved)
        if saved.get("residual") is not None:
            self.residual = saved["residual"]
