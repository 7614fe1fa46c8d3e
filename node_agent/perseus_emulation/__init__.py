"""Stand-ins for training on GPUs, for demos and tests: nothing here runs on a real node.

- :mod:`perseus_emulation.job`: a whole data-parallel x pipeline-parallel job, every rank a
  thread, on emulated GPUs (``python -m perseus_emulation.job``).
- :mod:`perseus_emulation.rank`: one rank's process driving an agent's emulated GPU.
- :mod:`perseus_emulation.torch_stage`: a torch pipeline stage that keeps an emulated GPU busy.
- :mod:`perseus_emulation.instruction_padding`: the same for DeepSpeed and Megatron computations.

The emulated GPU itself is a backend of the agent (:mod:`perseus_agent.gpu.emulated`) and
stays there; this package may import it and :mod:`perseus_client`, and the agent never
imports this package.
"""
