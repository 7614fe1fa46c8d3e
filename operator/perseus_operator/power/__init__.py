"""Cluster power budgets: each PerseusPowerBudget's allocation of watts to the jobs of its domain.

Pure decisions (``budget_decisions``: when to solve the allocation again, which jobs to
re-target to which frontier point, the budget's status; ``budget_events``: the Events a round
posts, and the gate that bounds them); what a domain holds and its measured draw, managed and
unmanaged (``domain``), read from the Prometheus that scrapes the agents (``prometheus_draw``,
a bounded HTTP client) or from the node plans' reports; the controller that carries them out
(``budget_controller``: reads the cluster, re-targets jobs through their annotation, writes the
status, posts the Events). May import ``cluster``, ``jobs``, ``workloads``
and ``metrics``.
"""
