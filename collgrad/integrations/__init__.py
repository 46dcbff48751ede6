"""Integrations with training frameworks (optional extra: ``pip install 'collgrad[hf]'``).

accelerate.py    register_pre_step_hook(accelerator, fn): the hook on the engine ``accelerator.prepare`` built;
                 save_model(accelerator, model, directory): accelerator.save_model through save_full_model
transformers.py  GradStatsCallback: per-layer gradient norms in the Trainer's logs; save_model(trainer):
                 trainer.save_model through save_full_model
"""
