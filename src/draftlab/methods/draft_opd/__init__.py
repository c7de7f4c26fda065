"""Draft-OPD: on-policy distillation that replays drafting from verification-exposed errors."""
