"""Training helpers for `train_accelerate.py`: data pipeline, checkpoints, Hub, logging, model cards.

Not remote code: nothing in `modeling_nsa/` imports this package, so a saved checkpoint loads without it.
"""
