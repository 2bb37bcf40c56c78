"""Training a draft model for a target: data from the target itself, distillation, export."""
