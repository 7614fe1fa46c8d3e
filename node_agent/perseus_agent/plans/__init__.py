"""The plans of several jobs on one node: which job's plan each GPU follows.

Owns the set of node plans the Kubernetes mode hands over (``job_plans``), the plans it refuses
whole (``plan_limits``), the arbitration of a GPU two plans claim (``gpu_arbitration``) and the
status an invalid plan gets (``plan_status``). May import ``ownership``, ``control`` and
everything below them, and the agent's ``kube`` types; never ``modes``.
"""
