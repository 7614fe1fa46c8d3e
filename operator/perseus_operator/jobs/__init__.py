"""One PerseusJob's reconcile: observe, decide, plan, write.

Owns the phase machine (``lifecycle`` executing ``job_decisions``, ``phase_decisions``,
``running_decisions``, ``job_release``), what a round reads (``job_observation``), profiling
progress (``profiling_watch``), profiles (``profile_source``, ``profile_store``), planning
(``planning``, ``planner_pool``), GPU conflicts between jobs (``gpu_conflicts``), straggler
detection (``stragglers``; its input ``straggler_samples``, its memory ``straggler_state``),
the agents' reports (``node_status``), what a step may reuse of the last one
(``quiet_steps``) and a job's memory between steps (``job_memo``). Reads and writes the
cluster only through the ``JobIO`` protocol; may import ``workloads``; never ``cluster``,
``policies``, ``webhook`` or the kopf adapters.
"""
