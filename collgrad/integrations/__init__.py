"""Integrations with training frameworks (optional extra: ``pip install 'collgrad[hf]'``).

accelerate.py    register_pre_step_hook(accelerator, fn): the hook on the engine ``accelerator.prepare`` built
transformers.py  GradStatsCallback: per-layer gradient norms in the Trainer's logs
"""
