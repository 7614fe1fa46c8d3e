"""One plan applied to its GPUs while training runs.

Owns the applier (``applier``), each GPU's runtime state (``plan_state``), clock changes
(``gpu_clocks``, ``instruction_clocks``), iteration statistics (``iteration_stats``), the
profiling sweep (``profiling_session``) and the answers to the training processes' requests
(``training_requests``). May import ``exporter``, ``profiling``, ``serving``, ``clocks`` and
``gpu``; never ``ownership``, ``plans`` or ``modes``.
"""
