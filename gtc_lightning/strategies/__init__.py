"""The Lightning strategies, one module per strategy family (:mod:`.gtc`, :mod:`.averaging`,
:mod:`.bmuf`, :mod:`.dpsgd`, :mod:`.baselines`), the Fabric strategy (:mod:`.fabric`), the glue they
share (:mod:`.common`: registration, DDP's hook arguments) and the per-rank shard format of GTC's
checkpoints (:mod:`.checkpoint`). They only wire the algorithms of :mod:`gtc_lightning.algorithms` into
Lightning; importing ``gtc_lightning`` registers their names."""
