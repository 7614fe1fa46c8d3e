"""An emulated data-parallel x pipeline-parallel training job: every rank a thread.

It plays all the pods of a training job, on several emulated nodes, for end-to-end tests and
demos without GPUs. Each rank is a thread that behaves like :mod:`perseus_emulation.rank`
(the ``perseus_client`` hooks around each forward and backward, the emulated GPU busy for the
time the profile measured at the clock now in effect, scaled by ``time_scale``), but the ranks
also wait on each other as real pipeline-parallel training does:

* Layout, as the operator assigns it: global rank ``r`` is stage ``r % S`` of data-parallel
  replica ``r // S`` (``S`` stages); node ``k`` (in the order given) hosts ranks
  ``k*G .. k*G+G-1`` on its GPU indices ``0..G-1`` (``G`` GPUs per node, the same on every
  node, and nodes x ``G`` = ``S`` x replicas).
* Pipeline dependencies: before the forward of microbatch ``m``, stage ``s > 0`` waits until
  stage ``s-1`` of its replica has finished the forward of ``m``; before the backward of ``m``,
  stage ``s < S-1`` waits until stage ``s+1`` has finished the backward of ``m``. A waiting
  GPU is idle (it draws blocking power).
* Gradient all-reduce: after its iteration's ``on_step_end`` every rank waits for all ranks of
  every replica (a barrier), outside the step hooks: each replica's reported iteration time is
  its own pipeline's, as the operator's straggler detection expects, while the GPUs of a fast
  replica idle at blocking power until the slowest replica is done.

An instruction runs for its profiled time at the GPU's current SM clock times the GPU's
slowdown (:meth:`EmulatedBackend.set_slowdown`), scaled by ``time_scale``. The clock and the
slowdown are read again while an instruction runs, 0.5 ms after it starts and then at doubling
intervals up to ``clock_poll_s`` (except in its last stretch, up to twice that), and the rest
of its work goes at the new rate: the node agent applies the clock of an instruction a moment
after the (pipelined) hook that announced it.
A rank marks its GPU busy as an instruction starts, and idle only when it has to wait (for
another stage or the all-reduce): between back-to-back instructions it goes straight from one
to the next, so that no state-file write delays the hand-off to the next stage.

Timing overhead: a rank that waits on another stage's computation is woken when that
computation enters its last stretch (its end then final) and sleeps until the end, so a thread
wake-up (0.2-1 ms on a loaded 2-core machine) no longer lands on each hand-off along the
critical path, as a GPU's data hand-off costs next to nothing; what is left of it is counted
(``handoff_s``). ``time.sleep`` oversleeps by ~0.1 ms: each rank learns by how much and wakes
up that much earlier. The hooks' own time stays on the rank's timeline (the client's
``synchronize`` puts it there on a real GPU too) and is counted (``hook_s``).

After every iteration (once all ranks are at the barrier, every GPU idle) the job records an
:class:`IterationRecord`; as JSON (:meth:`IterationRecord.to_json`)::

    {"iteration": 3,                       # step number, from 0
     "end_s": 81234.567,                   # time.monotonic() when the iteration ended
     "replica_times_s": [0.081, 0.097],    # per replica: its ranks' earliest on_step_begin
                                           # to their latest on_step_end, in seconds
     "energy_j": 51234.5,                  # sum of the energy counters of all the job's GPUs
     "node_energy_j": {"node-0": 25617.2, "node-1": 25617.3},
     "busy_s": 12.34,                      # sum of the GPUs' busy-time counters
     "node_busy_s": {"node-0": 6.17, "node-1": 6.17},
     "overheads": {"hook_s": 0.004, ...}}   # the emulation's own costs, summed over the
                                           # ranks (OVERHEADS says what each key means)

Counters are the emulated GPUs' own (:meth:`EmulatedBackend.metered_energy_j`,
:meth:`EmulatedBackend.busy_s`): cumulative since the GPU state was created, so with a shared
state file they include whatever ran before; the energy of an iteration is the difference of
two records'.

The job runs ``steps`` iterations, or until :meth:`EmulatedJob.stop` (SIGTERM or SIGINT in the
command line); it stops between iterations. An error in any rank (or in the iteration
bookkeeping) stops every rank and :meth:`EmulatedJob.run` raises :class:`EmulatedJobError`.
On the way out every rank leaves its GPU idle and closes its client (which first waits for
the agent to answer the hooks already sent).

Command line (one JSON record a line appended to ``--log`` after each iteration, flushed; a
summary JSON line on stdout at the end; exit status 0, 1 when the job failed, 2 for bad
arguments)::

    python -m perseus_emulation.job --profile gpt3.csv --blocking-power 83.64 \\
        --stages 4 --replicas 2 --microbatches 8 --time-scale 0.1 --steps 20 \\
        --log iterations.jsonl \\
        --node name=node-0,gpus=4,socket=/run/perseus-0/agent.sock,state=/tmp/node-0.json \\
        --node name=node-1,gpus=4,socket=/run/perseus-1/agent.sock,state=/tmp/node-1.json

``--node`` is repeated in node-rank order: ``gpus`` is required; ``name`` defaults to
``node-<k>``; ``socket`` (the node agent's socket; a missing socket makes the hooks no-ops)
and ``state`` (the emulated GPU state file shared with that node's agent) are optional: without
``socket`` no hooks are sent, without ``state`` the GPUs live in memory. Paths cannot contain
commas.
"""

from perseus_emulation.job.cli import main
from perseus_emulation.job.clients import ClientFactory, RankClient, default_client
from perseus_emulation.job.job import EmulatedJob
from perseus_emulation.job.records import (
    OVERHEADS,
    EmulatedJobError,
    IterationRecord,
    JobResult,
    NodeSpec,
    RankInfo,
)

__all__ = [
    "OVERHEADS",
    "ClientFactory",
    "EmulatedJob",
    "EmulatedJobError",
    "IterationRecord",
    "JobResult",
    "NodeSpec",
    "RankClient",
    "RankInfo",
    "default_client",
    "main",
]
