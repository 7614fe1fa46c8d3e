"""Perseus training-side hooks: tell the node agent when each step and forward/backward starts.

With ``Instruction`` granularity the node agent switches the GPU's SM clock at
every forward and backward of the pipeline schedule. The training container
stays unprivileged: it only reports what it is about to run, over the agent's
Unix socket (``$PERSEUS_AGENT_SOCKET``, default ``/run/perseus/agent.sock``,
a hostPath directory mounted into the pod), and the agent changes the clock.

Integration is two lines per hook site::

    import perseus_client as perseus

    for step in range(num_steps):
        with perseus.step(step):
            for kind, mb in pipeline_schedule:  # e.g. ("forward", 0), ("backward", 0), ...
                with perseus.instruction(kind, mb):  # kind: "forward" or "backward"
                    run(kind, mb)

A rank that runs several model chunks (interleaved 1F1B: model stage ``v * P + p`` on rank
``p`` is its chunk ``v``) names the chunk, ``perseus.instruction(kind, mb, chunk=v)``, and a
zero-bubble schedule names the backward halves ``"backward_input"`` and
``"backward_weight"`` (protocol version 2; see :mod:`perseus_client.protocol` for what
happens against an agent that speaks only version 1).

or, without context managers, ``perseus.on_step_begin(step)``,
``perseus.on_instruction_begin("forward", mb)`` (returns the SM clock now in
effect, or ``None``), ``perseus.on_instruction_end("forward")`` and
``perseus.on_step_end(step)``.

Identity comes from the environment: ``RANK``, ``LOCAL_RANK``, GPU UUIDs from
``NVIDIA_VISIBLE_DEVICES`` (else ``CUDA_VISIBLE_DEVICES``) when they hold
UUIDs, ``POD_NAME``, ``POD_NAMESPACE`` and ``PERSEUS_JOB``. For other settings
call ``perseus.configure(...)`` once (same arguments as :class:`PerseusClient`),
for example ``perseus.configure(synchronize=torch.cuda.synchronize)``: GPU work
is asynchronous, so synchronizing before each instruction hook makes the clock
change line up with the kernels rather than with the CPU running ahead.

The hooks never raise and never block for long: without a reachable agent they
log one warning (logger ``perseus_client``) and do nothing, retrying the
connection every 30 s. This package uses the standard library only.
"""

from perseus_client.client import PerseusClient
from perseus_client.default_client import (
    configure,
    get_client,
    instruction,
    on_instruction_begin,
    on_instruction_end,
    on_step_begin,
    on_step_end,
    step,
)
from perseus_client.identity import gpu_uuids_from_env
from perseus_client.protocol import DEFAULT_SOCKET_PATH, PROTOCOL_VERSION, SOCKET_ENV

__all__ = [
    "DEFAULT_SOCKET_PATH",
    "PROTOCOL_VERSION",
    "SOCKET_ENV",
    "PerseusClient",
    "configure",
    "get_client",
    "gpu_uuids_from_env",
    "instruction",
    "on_instruction_begin",
    "on_instruction_end",
    "on_step_begin",
    "on_step_end",
    "step",
]
