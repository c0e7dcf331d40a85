"""The update mode's work on the optimizer's moments (:mod:`gtc_lightning.algorithms.gtc.update`), after each
rank's optimizer stepped: DGC's momentum factor masking (``momentum_masking``) and Adam's step with the mean
gradient's second moment (``mean_variance``). Both take the parameters the optimizer moved this step
(:class:`~gtc_lightning.algorithms.gtc.update.Moved`: each one's flat range and learning rate)."""

from __future__ import annotations

import warnings

import torch

from gtc_lightning.algorithms.gtc.state import GTCState

MOMENTUM_KEYS = ("momentum_buffer", "exp_avg")  # SGD's (and RMSprop's) momentum, the Adam family's first moment


def mask_momentum(state: GTCState, optimizer: torch.optim.Optimizer, moved: list, own: torch.Tensor) -> None:
    """DGC's momentum factor masking: zero this rank's momentum at the elements it sent this step
    (``own``: its flat indices, ascending), so that momentum stops pushing what was just sent. The
    first of :data:`MOMENTUM_KEYS` a parameter's optimizer state holds is masked; an optimizer with
    none of them (plain SGD, Adagrad) is warned about once on rank 0 and left as it is."""
    edges = torch.searchsorted(own, torch.tensor([[m.offset, m.offset + m.numel] for m in moved], device=own.device))
    masked = False
    for m, (first, end) in zip(moved, edges.tolist()):
        entry = optimizer.state.get(m.param, {})
        buffer = next((entry[k] for k in MOMENTUM_KEYS if isinstance(entry.get(k), torch.Tensor)), None)
        if buffer is None:
            continue
        masked = True
        if first == end:
            continue
        flat = buffer.reshape(-1)  # a view when contiguous; else a copy, written back below
        flat.index_fill_(0, own[first:end] - m.offset, 0.0)
        if flat.data_ptr() != buffer.data_ptr():
            buffer.copy_(flat.view_as(buffer))
    if not masked and not state._warned_masking and state.rank == 0:
        state._warned_masking = True
        warnings.warn(
            f"GTC(momentum_masking=True): {type(optimizer).__name__}'s state holds none of {MOMENTUM_KEYS}: "
            "nothing is masked (plain SGD has no momentum). Set momentum_masking=False",
            RuntimeWarning,
            stacklevel=3,
        )


def mean_variance_step(state: GTCState, optimizer: torch.optim.Optimizer, moved: list) -> None:
    """Move each parameter of an Adam / AdamW step from the rank's own step to the step with the mean
    gradient's second moment (``mean_variance=True``), before the step is folded into the residual.

    A rank's gradient is the mean gradient ``mu`` plus noise of variance ``s2`` per element; the mean
    over ``W`` ranks has ``s2 / W``. So the rank's second moment ``v = mu^2 + s2`` is larger than DDP's
    ``mu^2 + s2 / W``, and its steps are shorter in the noisy directions (up to ``sqrt(W)`` times). The
    rank's first moment averages the noise over a few steps, ``E[m^2] = mu^2 + r s2`` with ``r`` the
    variance of Adam's bias-corrected average of unit noise after ``t`` steps (``(1 - b1) (1 + b1^t) /
    ((1 + b1) (1 - b1^t))``, 1/19 at ``b1 = 0.9``). The two give ``s2`` and ``mu^2``, and the mean
    gradient's second moment ``m^2 + (v - m^2) (1/W - r) / (1 - r)`` (the coefficient clipped to [0, 1]:
    ``m^2`` in the first few steps, where ``r >= 1/W``). The parameter moves by ``lr`` times the
    difference of ``m / (sqrt(v) + eps)`` and the same over the estimate; the optimizer's state is left
    as it is. Groups with ``amsgrad`` and optimizers other than :class:`torch.optim.Adam` and
    :class:`torch.optim.AdamW` are left as they are (warned about once on rank 0)."""
    opt = getattr(optimizer, "optimizer", optimizer)  # Lightning's and Fabric's wrappers
    adam = isinstance(opt, (torch.optim.Adam, torch.optim.AdamW))
    groups = {id(p): group for group in opt.param_groups for p in group["params"]} if adam else {}
    skipped = not adam
    world = state.world_size
    for m in moved:
        group, entry = groups.get(id(m.param)), opt.state.get(m.param, {}) if adam else {}
        if group is None or group.get("amsgrad") or "exp_avg_sq" not in entry or "exp_avg" not in entry:
            skipped = True
            continue
        beta1, beta2 = (float(b) for b in group["betas"])
        eps, lr, t = float(group["eps"]), float(group["lr"]), float(entry["step"])
        bc1, bc2 = 1.0 - beta1**t, 1.0 - beta2**t
        r = (1.0 - beta1) * (1.0 + beta1**t) / ((1.0 + beta1) * bc1)
        c = min(max((1.0 / world - r) / (1.0 - r), 0.0), 1.0) if r < 1.0 else 0.0
        m_hat = entry["exp_avg"].float() / bc1
        v_hat = entry["exp_avg_sq"].float() / bc2
        m2 = m_hat.square()
        v_mean = torch.lerp(m2, v_hat, c)
        own = m_hat / v_hat.sqrt_().add_(eps)
        diff = own.sub_(m_hat.div_(v_mean.sqrt_().add_(eps))).nan_to_num_(nan=0.0)  # 0 / 0 where m = v = 0, eps 0
        m.param.add_(diff.to(m.param.dtype), alpha=lr)
    if skipped and not state._warned_variance and state.rank == 0:
        state._warned_variance = True
        what = type(opt).__name__ if not adam else "some of its parameters (amsgrad, or no Adam state)"
        warnings.warn(
            f"GTC(mean_variance=True) corrects torch.optim.Adam and AdamW steps without amsgrad; {what}: their "
            "steps are left as the rank's optimizer made them. Set mean_variance=False, or use Adam / AdamW",
            RuntimeWarning,
            stacklevel=3,
        )
