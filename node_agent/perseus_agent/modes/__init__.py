"""How the agent runs: its configuration, its lifecycle, and its two modes.

Owns the start-up and shutdown of the daemon (``agent_config``, ``agent_lifecycle``), the
standalone mode (one plan file, no Kubernetes) and the Kubernetes mode (the node's
PerseusNodePlans, the PodResources API, the driver-upgrade gate: ``driver_release``,
``driver_upgrade``). The top of the agent below :mod:`perseus_agent.main`: may import every
other subpackage; nothing but ``main`` imports it.
"""
