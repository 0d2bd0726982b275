"""The model executor: runs a scheduler decision (``radixlm.runtime.scheduler.decision``)
on the device. Model runner, forward batch, sampling, attention backends, CUDA graphs
(decode and piecewise), the model loader and models/, and FP8 KV calibration.

Imports from the scheduler package only the contract (``decision``) and request state
(``request``).
"""
