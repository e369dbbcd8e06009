"""The step contract: what the engine side (scheduler, pipeline, grammar step) and the runner side
(model runner, sampler) exchange, as small typed values that can cross a process boundary.

sampling.py  the sampling columns: one table for a request's packed sampling constants, the
             counter-based RNG key and the hash constants the sampler's noise uses
step.py      the planned step (StepPlan: scheduled rows, requests entering and leaving the
             runner's table) and what comes back (CommittedToken, PromptScores)
inputs.py    the runner's per-step input schema (StepInputs, SamplingFlags): one field table,
             host numpy arrays staged into device views of the same names
runner.py    the interfaces the pipeline drives (StepRunner) and the runner asks for grammar masks
             through (MaskSource)

Dependencies point one way: photon.engine and photon.worker import photon.core; photon.core imports
neither, and photon.worker never imports photon.engine.
"""
