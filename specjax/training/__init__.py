"""Training: LM pretraining and draft-head training (optax + orbax), resumable after a kill."""
