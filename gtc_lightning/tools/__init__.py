"""Tools that no training run imports, each a ``python -m gtc_lightning.tools.X`` command: ``bench``
(kernels), ``bench_exchange``, ``bench_step`` (step time of each strategy), ``cluster`` (N emulated
nodes on network namespaces), ``bench_cluster``, ``faults``, ``soak``, ``scaling`` (also
``gtc-scaling``), ``simulate`` (N workers in one process) and ``model_suite`` (also
``gtc-model-suite``). They may import every layer of the package; none imports them."""
