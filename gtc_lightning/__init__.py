"""gtc-lightning: Strom's gradient threshold compression (GTC) as a PyTorch Lightning strategy.

Importing the package registers the strategy names ``"gtc"`` (processes started by re-running
the script, Lightning's default), ``"gtc_spawn"``, ``"gtc_fork"`` and ``"gtc_notebook"``, each
also as ``..._find_unused_parameters_true`` / ``_false`` (as Lightning names its DDP variants).
The other strategies of the family are registered the same way: ``"ma"`` (periodic model
averaging, :mod:`gtc_lightning.strategies.averaging`), ``"bmuf"`` and ``"bmuf_gtc"``
(:mod:`gtc_lightning.strategies.bmuf`), ``"dpsgd"``, ``"adpsgd"``, and the dense baselines ``"ddp_bf16"`` and
``"ddp_powersgd"``, ``"diloco"`` and ``"sparseloco"`` (DiLoCo's and SparseLoCo's block syncs,
:mod:`gtc_lightning.strategies.sparseloco`), and ``"gtc_hsdp"`` (FSDP2 within a node, GTC across nodes,
:mod:`gtc_lightning.strategies.hsdp`); Fabric's registry gets ``"gtc"`` too.
Processes started by re-running the script import the package again through the script itself,
so they know the names too. Use it in a Lightning project like this::

    import lightning as L
    import gtc_lightning  # registers "gtc"
    from gtc_lightning import GTCStrategy

    model, data = MyLightningModule(), MyDataModule()
    # by name, with the defaults (tau="auto" at density 1e-2, Rice coding, compress="auto"):
    trainer = L.Trainer(accelerator="gpu", devices=8, strategy="gtc")
    # or configured: threshold, 100 dense warmup steps, replica check every 1000 steps
    strategy = GTCStrategy(tau=1e-2, warmup_steps=100, check_replicas_every=1000, bucket_cap_mb=25)
    trainer = L.Trainer(accelerator="gpu", devices=8, num_nodes=2, strategy=strategy)
    trainer.fit(model, data)  # logs gtc/bytes_sent, gtc/ratio_fp32, ...; "gtc_vs_bf16" in the bar
    print(trainer.strategy.gtc_stats["total"]["ratio_bf16"])  # bf16 all-reduce bytes per byte sent

A fixed ``tau`` works best near 15x the per-rank gradient RMS (measured on the recipe's DNN);
``tau="auto"``, the default, presumes no gradient scale.

The package is laid out in layers (docs/architecture.md): :mod:`gtc_lightning.ops` (kernels and
their torch twins), :mod:`gtc_lightning.algorithms` (GTC and the averaging family, torch only),
:mod:`gtc_lightning.strategies` (the Lightning and Fabric strategies) and :mod:`gtc_lightning.tools`
(benchmarks, the cluster emulator, simulations: never imported by a training run). The module paths
of 0.1.0 at the top were removed in 0.3.0 (CHANGELOG.md maps each to its new home).
"""

import logging

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from gtc_lightning.algorithms.averaging import ADPSGDState, AveragingState, BMUFState, DPSGDState, SyncStats
from gtc_lightning.algorithms.common import parameter_checksums
from gtc_lightning.algorithms.gtc import GTCState, StepStats, gtc_hook
from gtc_lightning.algorithms.hooks import bf16_allreduce_hook
from gtc_lightning.algorithms.sparseloco import SparseLoCoState
from gtc_lightning.strategies.adpsgd import ADPSGDStrategy
from gtc_lightning.strategies.averaging import ModelAveragingStrategy
from gtc_lightning.strategies.baselines import BF16AllReduceStrategy, PowerSGDStrategy
from gtc_lightning.strategies.bmuf import BMUFGTCStrategy, BMUFStrategy
from gtc_lightning.strategies.dpsgd import DPSGDStrategy
from gtc_lightning.strategies.fabric import GTCFabricStrategy, register_trainer_only_names
from gtc_lightning.strategies.gtc import GTCStrategy
from gtc_lightning.strategies.hsdp import GTCHSDPStrategy
from gtc_lightning.strategies.sparseloco import SparseLoCoStrategy, register_diloco

__all__ = [
    "ADPSGDState",
    "ADPSGDStrategy",
    "AveragingState",
    "BF16AllReduceStrategy",
    "BMUFGTCStrategy",
    "BMUFState",
    "BMUFStrategy",
    "DPSGDState",
    "DPSGDStrategy",
    "GTCFabricStrategy",
    "GTCHSDPStrategy",
    "GTCState",
    "GTCStrategy",
    "ModelAveragingStrategy",
    "PowerSGDStrategy",
    "SparseLoCoState",
    "SparseLoCoStrategy",
    "StepStats",
    "SyncStats",
    "bf16_allreduce_hook",
    "gtc_hook",
    "parameter_checksums",
]
__version__ = "0.3.0"

# Show the configuration line and restore messages at INFO, the way Lightning's own logger does,
# unless the application configured logging itself.
_logger = logging.getLogger(__name__)
if not logging.getLogger().hasHandlers() and not _logger.handlers:
    _logger.setLevel(logging.INFO)
    _logger.addHandler(logging.StreamHandler())
    _logger.propagate = False

if "gtc" not in StrategyRegistry:
    GTCStrategy.register_strategies(StrategyRegistry)
if "gtc_hsdp" not in StrategyRegistry:
    GTCHSDPStrategy.register_strategies(StrategyRegistry)
if "ddp_bf16" not in StrategyRegistry:
    BF16AllReduceStrategy.register_strategies(StrategyRegistry)
if "ddp_powersgd" not in StrategyRegistry:
    PowerSGDStrategy.register_strategies(StrategyRegistry)
for _cls in (
    ModelAveragingStrategy, BMUFStrategy, BMUFGTCStrategy, DPSGDStrategy, ADPSGDStrategy, SparseLoCoStrategy,
):  # fmt: skip
    if _cls.name not in StrategyRegistry:
        _cls.register_strategies(StrategyRegistry)
if "gtc" not in FABRIC_STRATEGY_REGISTRY:  # Lightning Fabric has a registry of its own
    GTCFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)
if "diloco" not in StrategyRegistry:
    register_diloco(StrategyRegistry)
register_trainer_only_names(FABRIC_STRATEGY_REGISTRY)  # ma, bmuf, ...: a clear error in Fabric
